"""What an SGLang rank of the pddcore backend reads from SGLang's arguments and the
environment: where its KV pool lives, the address it publishes, and which side it is.

Example::

    kv_device(kv_args, server_args)    # device(type='cuda', index=kv_args.gpu_id), or cpu
    advertised_host()                  # $PDDCORE_SGLANG_HOST, else SGLang's local IP
    staging_bytes()                    # $PDDCORE_SGLANG_STAGING_BYTES, else 4 GiB
    mode_name(DisaggregationMode.PREFILL)   # 'prefill'
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.utils.network import get_local_ip_auto

__all__ = ["HOST_ENV", "STAGING_ENV", "kv_device", "advertised_host", "staging_bytes", "mode_name",
           "check_supported"]

HOST_ENV = "PDDCORE_SGLANG_HOST"
STAGING_ENV = "PDDCORE_SGLANG_STAGING_BYTES"
DEFAULT_STAGING_BYTES = 4 << 30


def kv_device(kv_args: KVArgs, server_args: Any) -> torch.device:
    """The device of this rank's KV pool: ``server_args.device`` names the kind (SGLang resolves
    an unset one at launch; unset here means SGLang's default, CUDA) and ``kv_args.gpu_id`` the GPU."""
    kind = (getattr(server_args, "device", None) or "cuda").split(":")[0]
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", int(kv_args.gpu_id))
    raise ValueError(f"the pddcore backend moves KV on cpu or cuda, not on {kind!r}")


def advertised_host() -> str:
    """The address this rank's engine listens on and publishes to its peers:
    ``$PDDCORE_SGLANG_HOST``, else the local IP SGLang's own connectors publish."""
    host = os.environ.get(HOST_ENV) or get_local_ip_auto()
    if host in ("0.0.0.0", "::"):
        raise ValueError(f"{HOST_ENV}={host} is a wildcard; peers need an address of this machine they can reach")
    return host


def staging_bytes() -> int:
    """The size of each rank's staging arena, allocated (pinned, for GPU KV) when the manager
    starts: ``$PDDCORE_SGLANG_STAGING_BYTES``, else 4 GiB. It holds the packed chunks a prefill
    rank has in flight, and the whole of each request a decode rank is receiving."""
    value = os.environ.get(STAGING_ENV)
    if value is None:
        return DEFAULT_STAGING_BYTES
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"{STAGING_ENV}={value!r} must be a positive number of bytes")
    return size


def mode_name(mode: Any) -> str:
    name = getattr(mode, "value", mode)
    if name not in ("prefill", "decode"):
        raise ValueError(f"disaggregation_mode must be prefill or decode, got {mode!r}")
    return name


def check_supported(kv_args: KVArgs, server_args: Any) -> None:
    """Raises ValueError, at start, for a deployment this backend would serve wrongly: DP
    attention (each attention-DP group pulls from its own prefill group, which the bootstrap
    table does not record), pipeline parallelism (each PP stage holds only its layers), and an
    EAGLE draft pool appended to ``kv_data_ptrs`` (its planes would be taken for V planes)."""
    problems = []
    if getattr(server_args, "enable_dp_attention", False) and int(getattr(server_args, "dp_size", 1)) > 1:
        problems.append(f"DP attention (--enable-dp-attention, --dp-size {server_args.dp_size})")
    if int(getattr(server_args, "pp_size", 1)) > 1:
        problems.append(f"pipeline parallelism (--pp-size {server_args.pp_size})")
    if int(getattr(kv_args, "num_draft_entries", 0) or 0) > 0:
        problems.append(f"a speculative-decoding draft KV pool ({kv_args.num_draft_entries} draft planes, e.g. EAGLE)")
    if problems:
        raise ValueError(f"the pddcore SGLang backend does not support {' or '.join(problems)}; serve this "
                         "deployment with SGLang's mooncake or nixl backend")
