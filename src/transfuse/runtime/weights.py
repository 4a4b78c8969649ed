"""Keeps merged weight buffers (passes/merge_linears.py) in step with the user's parameters.

The parameters are views of the merged buffer, so in-place updates (`load_state_dict`, an optimizer
step) reach the GEMM with no work here. A parameter the user *replaced* (a new tensor assigned, or
`.data` swapped) no longer points into the buffer: before every call the view addresses are compared
(one integer compare per parameter), and a mismatch copies the new values in and re-points the
parameter. The buffer's own address never changes, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

import torch


class MergedWeights:
    def __init__(self, groups: list[tuple[list[torch.Tensor], torch.Tensor]]):
        # Hold the buffers strongly; the members are the user's parameters (held by the model).
        self.groups = []
        for members, fused in groups:
            addresses = []
            start = 0
            for m in members:
                addresses.append(fused[start : start + m.shape[0]].data_ptr())
                start += m.shape[0]
            self.groups.append((members, fused, addresses))

    def refresh(self) -> int:
        """Re-point replaced parameters; returns how many were copied in."""
        copied = 0
        for members, fused, addresses in self.groups:
            for i, (m, address) in enumerate(zip(members, addresses)):
                if m.data_ptr() != address:
                    self._copy_in(members, fused, i)
                    copied += 1
        return copied

    @staticmethod
    def _copy_in(members, fused, index) -> None:
        start = sum(m.shape[0] for m in members[:index])
        member = members[index]
        view = fused[start : start + member.shape[0]]
        if member.shape != view.shape or member.dtype != view.dtype:
            raise RuntimeError(
                "transfuse: a merged parameter changed shape or dtype in place; call transfuse.restore(model) "
                "and optimize again"
            )
        with torch.no_grad():
            view.copy_(member.detach())
        member.data = view

    def unmerge(self) -> None:
        """Give every parameter its own storage again (transfuse.restore)."""
        for members, _, _ in self.groups:
            for m in members:
                m.data = m.data.clone()
