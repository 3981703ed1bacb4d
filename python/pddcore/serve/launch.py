"""Builds and runs a gateway from ``pddcore serve``'s options (also what tests and the
benchmark use to run one inside their own event loop)."""

from __future__ import annotations

import argparse
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
from aiohttp import web

from ..handoff import HandoffPolicy
from .app import GatewayApp
from .gateway import Gateway, GatewayConfig
from .link_stats import LinkFollower
from .upstream import Upstream, UpstreamError

__all__ = ["serve_gateway"]


@asynccontextmanager
async def serve_gateway(args: argparse.Namespace, *, api_key: str | None = None) -> AsyncIterator[str]:
    """Serves until the block ends; yields the gateway's URL."""
    async with aiohttp.ClientSession() as http:
        def upstreams(urls: list[str], role: str) -> list[Upstream]:
            return [Upstream(u, role, http, connect_timeout_s=args.connect_timeout_s,
                             read_timeout_s=args.read_timeout_s, api_key=api_key) for u in urls]

        prefill, relay, main = upstreams(args.prefill, "prefill"), upstreams(args.relay, "relay"), \
            upstreams(args.main, "main")
        kv_bytes, page_size = args.kv_bytes_per_token, args.page_size
        if args.engine == "reference" and (kv_bytes is None or page_size is None):
            try:
                info = await prefill[0].get_json("/pdd/info")
            except UpstreamError as e:
                raise ValueError(f"cannot read the KV size from {prefill[0].url}/pdd/info: {e}") from None
            kv_bytes = kv_bytes if kv_bytes is not None else float(info["kv_bytes_per_token"])
            page_size = page_size if page_size is not None else int(info["page_size"])
        if kv_bytes is None:
            raise ValueError("--kv-bytes-per-token is required with --engine vllm (layers x 2 x KV heads x head "
                             "dim x bytes per element)")
        config = GatewayConfig(kv_bytes_per_token=kv_bytes, page_size=page_size or 16, ttft_slo_s=args.ttft_slo_s,
                               rld_tpot_s=args.rld_tpot_s, rld_capacity=args.rld_capacity,
                               prior_wan_bytes_per_s=args.wan_mbps * 1e6 / 8, prior_wan_rtt_s=args.wan_rtt_ms / 1e3,
                               prefetch_timeout_s=args.prefetch_timeout_s, md_cache_tokens=args.md_cache_tokens,
                               policy=HandoffPolicy(catch_up_threshold=args.catch_up_threshold))
        gateway = Gateway(prefill, relay, main, config)
        if args.engine == "reference":  # engines that serve their transfer counters
            gateway.keep_running(LinkFollower(gateway, args.link_poll_s).run())
        runner = web.AppRunner(GatewayApp(gateway, model_name=args.served_model_name).app(),
                               handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        try:
            yield f"http://{args.host}:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()
