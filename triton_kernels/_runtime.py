"""Where the Triton kernels can run in this process.

Triton chooses between compiling and interpreting when ``triton`` is imported (its own
``tl`` helpers are ``@triton.jit`` functions too), so CPU tensors can only run the
kernels if ``TRITON_INTERPRET=1`` was set before that import.
"""

from __future__ import annotations

import torch
import triton

__all__ = ["is_interpreted", "require_runnable"]


def is_interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


def require_runnable(device: torch.device) -> None:
    """Raise before any launch when tensors on `device` cannot run here."""
    if device.type == "cpu" and not is_interpreted():
        raise RuntimeError("Triton kernels on CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "in the environment before triton is first imported")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the Triton kernels run on CUDA tensors (or CPU ones when interpreted), not {device.type}")
