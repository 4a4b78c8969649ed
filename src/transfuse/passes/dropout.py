"""Dropout that is the identity: `F.dropout(x, p, training=False)` or p == 0 (eval-mode models,
and Hugging Face's `dropout=0.0 if not self.training else ...`). Removing it lets the attention and
epilogue passes see contiguous chains."""

from __future__ import annotations

from transfuse.passes.graph import arg, kind, scalar
from transfuse.passes.manager import PassContext

PATTERN = "EvalDropout"


def run(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.nodes):
        if kind(node) != "dropout":
            continue
        p = scalar(arg(node, 1, "p", 0.5))
        training = arg(node, 2, "training", True)
        if p == 0.0 or training is False:
            node.replace_all_uses_with(node.args[0])
            ctx.gm.graph.erase_node(node)
            ctx.matched(PATTERN)
        else:
            ctx.reject(PATTERN, node, f"dropout with p={p} in training mode is not the identity")
