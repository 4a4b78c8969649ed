"""torch.library custom ops in the `transfuse` namespace: schema, fake implementation, autograd.

Importing this package registers every op (torch.ops.transfuse.*)."""

from transfuse.ops import attention, attention_train, clamp, cross_entropy, gemm, kv_cache, norm, rotary  # noqa: F401  (registers the ops)
