"""`pddcore info`: what was compiled in and what is usable on this machine."""

from __future__ import annotations

import argparse
import os
import platform

from . import _C, __version__


def collect() -> dict:
    """Returns the facts `pddcore info` prints, as a dict (also recorded by benchmarks)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda_reason = _C.cuda_unusable_reason()
    verbs_loaded, verbs_devices, verbs_detail = _C.probe_verbs()
    return {
        "pddcore": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_pack_threads": _C.get_num_threads(),
        "crc32c": _C.crc32c_implementation(),
        "cuda_compiled": _C.cuda_compiled(),
        "cuda_usable": cuda_reason == "",
        "cuda_detail": cuda_reason or f"{_C.cuda_device_count()} device(s)",
        "ibverbs_loaded": verbs_loaded,
        "rdma_devices": verbs_devices,
        "rdma_detail": verbs_detail,
        "rdma_backend_compiled": _C.rdma_compiled(),
        "torch": torch.__version__,
        "torch_cuda": torch.cuda.is_available(),
        "triton": triton_version,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    facts = collect()
    if args.json:
        import json

        print(json.dumps(facts, indent=2))
        return 0
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    print(f"pddcore {facts['pddcore']}  (python {facts['python']}, {facts['machine']}, {facts['cpu_count']} cores)")
    print(f"  CPU pack/unpack   : yes, {facts['cpu_pack_threads']} threads")
    print(f"  CRC32C            : {facts['crc32c']} (this CPU can run: {', '.join(_C.crc32c_implementations())})")
    print(f"  CUDA compiled     : {yes(facts['cuda_compiled'])}")
    print(f"  CUDA usable       : {yes(facts['cuda_usable'])} ({facts['cuda_detail']})")
    print(f"  ibverbs           : {'loaded' if facts['ibverbs_loaded'] else 'absent'}, "
          f"{facts['rdma_devices']} RDMA device(s)" + (f" ({facts['rdma_detail']})" if facts["rdma_detail"] else ""))
    print("  RDMA backend      : " + ("compiled (libibverbs opened at run time; device='emulator' for the verbs "
                                   "emulator)" if facts["rdma_backend_compiled"]
                                   else "compiled out (no ibverbs headers at build time)"))
    print(f"  torch             : {facts['torch']} (CUDA available: {yes(facts['torch_cuda'])})")
    print(f"  triton            : {facts['triton'] or 'not installed'}")
    return 0
