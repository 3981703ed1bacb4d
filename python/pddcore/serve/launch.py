"""Builds and runs a gateway from ``pddcore serve``'s options (also what tests and the
benchmark use to run one inside their own event loop)."""

from __future__ import annotations

import argparse
from contextlib import asynccontextmanager
from typing import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from ..handoff import HandoffPolicy
from .app import GatewayApp
from .gateway import Gateway, GatewayConfig
from .link_stats import LinkFollower
from .pipelines import SGLangPipeline, VllmPipeline
from .sglang_upstream import SGLangUpstream
from .upstream import Upstream, UpstreamError

__all__ = ["serve_gateway"]


@asynccontextmanager
async def serve_gateway(args: argparse.Namespace, *, api_key: str | None = None) -> AsyncIterator[str]:
    """Serves until the block ends; yields the gateway's URL."""
    async with aiohttp.ClientSession() as http:
        kind = SGLangUpstream if args.engine == "sglang" else Upstream

        def upstreams(urls: list[str], role: str) -> list[Upstream]:
            return [kind(u, role, http, connect_timeout_s=args.connect_timeout_s,
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
        pipeline = VllmPipeline()
        if args.engine == "sglang":
            bootstrap, reported_page = await _sglang_bootstrap(prefill, args.bootstrap_port)
            pipeline = SGLangPipeline(bootstrap)
            page_size = page_size if page_size is not None else reported_page
        if kv_bytes is None:
            raise ValueError(f"--kv-bytes-per-token is required with --engine {args.engine} (layers x 2 x KV heads "
                             "x head dim x bytes per element)")
        config = GatewayConfig(kv_bytes_per_token=kv_bytes, page_size=page_size or 16, ttft_slo_s=args.ttft_slo_s,
                               rld_tpot_s=args.rld_tpot_s, rld_capacity=args.rld_capacity,
                               prior_wan_bytes_per_s=args.wan_mbps * 1e6 / 8, prior_wan_rtt_s=args.wan_rtt_ms / 1e3,
                               prefetch_timeout_s=args.prefetch_timeout_s, md_cache_tokens=args.md_cache_tokens,
                               policy=HandoffPolicy(catch_up_threshold=args.catch_up_threshold))
        gateway = Gateway(prefill, relay, main, config, pipeline=pipeline)
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


async def _sglang_bootstrap(prefill: list[Upstream], port: int | None) -> tuple[dict[str, tuple[str, int]], int | None]:
    """Each SGLang P's bootstrap server (its URL's host; the port given, else the one its
    ``/server_info`` reports), and the KV page size the first P reports."""
    out, page_size = {}, None
    for p in prefill:
        host = urlsplit(p.url).hostname
        if port is not None:
            out[p.url] = (host, port)
            continue
        try:
            info = await p.get_json("/server_info")
        except UpstreamError as e:
            raise ValueError(f"cannot read {p.url}/server_info for its bootstrap port (or give --bootstrap-port): "
                             f"{e}") from None
        reported = _field(info, "disaggregation_bootstrap_port")
        if _field(info, "disaggregation_mode") != "prefill" or not isinstance(reported, int):
            raise ValueError(f"{p.url} is not an SGLang prefill server (--disaggregation-mode prefill): its "
                             "/server_info names no prefill mode and bootstrap port")
        out[p.url] = (host, reported)
        page_size = page_size or _field(info, "page_size")
    return out, page_size


def _field(info: dict, name: str):
    """A field of SGLang's ``/server_info``: at the top, or one record down."""
    if name in info:
        return info[name]
    return next((v[name] for v in info.values() if isinstance(v, dict) and name in v), None)
