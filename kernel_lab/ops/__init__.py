"""The public kernels. Each op validates its inputs, then follows the dispatch rule in `common.py`:
CUDA tensors run the GPU kernel; CPU tensors run the PyTorch reference, or the Triton kernel through the
interpreter when TRITON_INTERPRET=1."""

from .gemm import matmul
from .kv_cache import allocate_kv_cache, write_kv
from .moe import moe
from .paged_attention import paged_decode_attention
from .rmsnorm import fused_add_rms_norm, rms_norm
from .sampling import sample, topk
from .swiglu import silu_and_mul

__all__ = [
    "rms_norm", "fused_add_rms_norm", "paged_decode_attention", "write_kv", "allocate_kv_cache",
    "silu_and_mul",
    "matmul",
    "topk", "sample",
    "moe",
]
