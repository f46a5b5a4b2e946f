"""The public kernels. Each op validates its inputs, then runs the path the dispatch rule picks for its
tensors' device (the rule: docs/architecture.md, "The dispatch rule"; each op states its own paths)."""

from .gemm import matmul
from .kv_cache import allocate_kv_cache, write_kv
from .moe import moe
from .paged_attention import paged_decode_attention
from .rmsnorm import fused_add_rms_norm, rms_norm
from .sampling import sample, topk
from .speculative import rejection_sample
from .swiglu import gelu_and_mul, silu_and_mul
from .token_bitmask import apply_token_bitmask

__all__ = [
    "rms_norm", "fused_add_rms_norm", "paged_decode_attention", "write_kv", "allocate_kv_cache",
    "silu_and_mul", "gelu_and_mul",
    "matmul",
    "topk", "sample", "apply_token_bitmask", "rejection_sample",
    "moe",
]
