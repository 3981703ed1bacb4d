"""`pddcore serve`: the OpenAI-compatible PDD gateway (:mod:`pddcore.serve`) in front of
prefill, relay-decode and main-decode engine servers.

Prints one JSON line once it serves (``{"url": ...}``), so a launcher that asked for
port 0 learns where it listens; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill (P) engines")
    parser.add_argument("--relay", nargs="*", default=[], metavar="URL",
                        help="relay-decode (RLD) engines, next to P (none: P -> MD only)")
    parser.add_argument("--main", nargs="*", default=[], metavar="URL",
                        help="main-decode (MD) engines, across the WAN (none: P -> RLD only)")
    parser.add_argument("--engine", choices=("vllm", "sglang", "reference"), default="vllm",
                        help="the engines' dialect: vllm (vllm serve with a KV connector), sglang "
                             "(sglang.launch_server in PD mode; also pddcore engine --dialect sglang) or reference "
                             "(pddcore engine, which also reports its KV size); default vllm")
    parser.add_argument("--bootstrap-port", type=int, default=None,
                        help="with --engine sglang: the prefill servers' bootstrap port (default: the one each "
                             "reports in /server_info)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (0: any free port; default 8080)")
    parser.add_argument("--kv-bytes-per-token", type=float, default=None,
                        help="KV bytes per token of the model (required for vllm and sglang; reference engines "
                             "report it)")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV block (default: 16, or reported)")
    parser.add_argument("--ttft-slo-s", type=float, default=3.0, help="the router's TTFT budget (default 3)")
    parser.add_argument("--rld-tpot-s", type=float, default=0.03, help="the router's price of an RLD token (0.03)")
    parser.add_argument("--rld-capacity", type=int, default=8, help="requests one RLD decodes at once (default 8)")
    parser.add_argument("--catch-up-threshold", type=int, default=64,
                        help="handoff backlog above which MD catches up while RLD decodes (default 64)")
    parser.add_argument("--wan-mbps", type=float, default=10000.0,
                        help="prior WAN bandwidth in Mbit/s until transfers are measured (default 10000)")
    parser.add_argument("--wan-rtt-ms", type=float, default=20.0, help="prior WAN RTT in ms (default 20)")
    parser.add_argument("--link-poll-s", type=float, default=1.0,
                        help="with --engine reference: how often to read P's transfer counters for the WAN estimate "
                             "(default 1)")
    parser.add_argument("--prefetch-timeout-s", type=float, default=60.0,
                        help="an MD pull taking longer leaves the request on RLD (default 60)")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0, help="engine connect timeout (default 5)")
    parser.add_argument("--read-timeout-s", type=float, default=120.0,
                        help="an engine call that sends nothing this long fails (default 120)")
    parser.add_argument("--md-cache-tokens", type=int, default=1 << 20,
                        help="tokens one MD's prefix cache holds, for the gateway's estimate (default 1M)")
    parser.add_argument("--served-model-name", default=None, help="model name in answers (default: P's /v1/models)")


def run(args: argparse.Namespace) -> int:
    from .launch import serve_gateway

    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    if not args.relay and not args.main:
        print("pddcore serve: give --relay or --main engines (or both)", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        api_key = os.environ.get("PDDCORE_ENGINE_API_KEY") or None
        async with serve_gateway(args, api_key=api_key) as url:
            print(json.dumps({"url": url}), flush=True)
            await stop.wait()

    try:
        asyncio.run(main())
    except ValueError as e:
        print(f"pddcore serve: {e}", file=sys.stderr)
        return 2
    return 0
