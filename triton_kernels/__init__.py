"""Triton kernels behind `pddcore.kernels` (installed as `pddcore.triton_kernels`).

Arguments are checked by `pddcore.kernels`, which is the public entry; call these
directly only to reach the extras (``num_kv_splits``). CUDA tensors run compiled; CPU
tensors run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set before
triton is imported (see `_runtime`).
"""

from .attention import decode_attention, extend_attention
from .store_kv import store_kv

__all__ = ["extend_attention", "decode_attention", "store_kv"]
