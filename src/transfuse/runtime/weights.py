"""Keeps merged weight buffers (passes/merge_linears.py) in step with the user's parameters.

The parameters are views of the merged buffer, so in-place updates (`load_state_dict`, an optimizer
step) reach the GEMM with no work here. A parameter the user *replaced* (a new Parameter assigned to
the module, or `.data` swapped) no longer points into the buffer: before every call the addresses of
the parameters Dynamo passes in are compared with the views (one integer compare per parameter), and
a mismatch copies the new values in and re-points the parameter. The buffer's own address never
changes, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

import torch


class MergedWeights:
    def __init__(self, groups: list[tuple[list[int], list[torch.Tensor], torch.Tensor]]):
        """groups: (graph input positions of the members, the members at compile time, merged buffer)."""
        self.groups = groups
        self.positions: list[int] = []
        self.views: list[torch.Tensor] = []
        for positions, members, fused in groups:
            start = 0
            for i, m in zip(positions, members):
                self.positions.append(i)
                self.views.append(fused[start : start + m.shape[0]])
                start += m.shape[0]
        self.addresses = [v.data_ptr() for v in self.views]

    def refresh(self, args) -> int:
        """Copy in and re-point parameters that no longer live in the buffer; returns how many."""
        current = [args[i].data_ptr() for i in self.positions]
        if current == self.addresses:
            return 0  # the common case: one C call per parameter and one list compare
        copied = 0
        for i, view, address, now in zip(self.positions, self.views, self.addresses, current):
            if now != address:
                self._copy_in(args[i], view)
                copied += 1
        return copied

    @staticmethod
    def _copy_in(param: torch.Tensor, view: torch.Tensor) -> None:
        if param.shape != view.shape or param.dtype != view.dtype or param.device != view.device:
            return  # not ours to fix: the caller sees the changed parameter and recompiles
        with torch.no_grad():
            view.copy_(param.detach())
        param.data = view

    def storages(self) -> set[int]:
        return {fused.untyped_storage().data_ptr() for _, _, fused in self.groups}
