"""torch.library custom ops in the `transfuse` namespace: schema, fake implementation, autograd.

Importing this package registers every op (torch.ops.transfuse.*)."""

from transfuse.ops import attention, attention_train, cache_write_attention, clamp, cross_entropy, embedding, gemm, kv_cache, linear_autograd, norm, norm_linear, qkv_rotary_cache, rotary, rotary_table  # noqa: F401  (registers the ops)
