"""What :class:`~pddcore.integrations.vllm.PDDConnector` reads from vLLM's configuration
beyond plain values: the addresses it listens on and advertises, and the one attention
KV-cache group it moves.

Example::

    advertised_host({"host": "0.0.0.0"})     # ('0.0.0.0', '10.1.2.3'): listen everywhere, publish get_ip()
    attention_spec(kv_cache_config)          # the group's AttentionSpec (head_size, head_size_v, ...)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["advertised_host", "attention_spec"]


def advertised_host(extra: Mapping[str, Any]) -> tuple[str, str]:
    """``(listen host, advertised host)`` from ``kv_connector_extra_config``: a wildcard or
    missing ``host`` is advertised as vLLM's ``get_ip()`` (``VLLM_HOST_IP`` when set), never as
    ``0.0.0.0``; ``advertise_host`` overrides the advertised one."""
    from vllm.utils.network_utils import get_ip

    listen = extra.get("host") or get_ip()
    advertise = extra.get("advertise_host") or listen
    if advertise in ("0.0.0.0", "::", ""):
        advertise = get_ip()
    return listen, advertise


def attention_spec(kv_cache_config: "KVCacheConfig | None") -> Any:
    """The one attention KV-cache group's spec; a clear error for hybrid models."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) != 1 or not isinstance(specs[0], AttentionSpec):
        raise ValueError("PDDConnector moves one attention KV-cache group; this model has "
                         f"{[type(spec).__name__ for spec in specs]} (a hybrid model, e.g. sliding-window or "
                         "Mamba layers under vLLM's hybrid KV-cache manager). Serve it with "
                         "--disable-hybrid-kv-cache-manager if its layers allow, or use another connector.")
    spec = specs[0]
    if getattr(spec, "state_content_bytes", None) is not None or getattr(spec, "num_head_slots", None) is not None:
        raise ValueError(f"PDDConnector: {type(spec).__name__} packs its pages itself (state_content_bytes / "
                         "num_head_slots); only dense K/V or MLA latent pages are supported")
    return spec
