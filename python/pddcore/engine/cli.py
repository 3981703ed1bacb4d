"""`pddcore engine`: the reference engine server (:mod:`pddcore.engine`) on the CPU.

Prints one JSON line once it serves (``{"url": ..., "transfer": ...}``), so a launcher
that asked for port 0 learns where it listens; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid

import torch

from .. import set_num_threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=("prefill", "decode"), required=True,
                        help="prefill: keeps KV for decode engines to pull; decode: pulls it")
    parser.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm",
                        help="the HTTP dialect: vllm (/inference/v1/generate with kv_transfer_params) or sglang "
                             "(/generate with the bootstrap fields of SGLang's PD mode); default vllm")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port; default 8000)")
    parser.add_argument("--model", default=None, help="Hugging Face folder (llama / qwen2); default: the embedded model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded model's weights (default 0)")
    parser.add_argument("--dtype", default="float64", help="model dtype (default float64)")
    parser.add_argument("--pool-pages", type=int, default=4096, help="KV pool pages (default 4096)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--transfer-listen", default=None,
                        help="host:port of the KV transfer engine (default: the HTTP host, any port)")
    parser.add_argument("--transfer-advertise", default=None, metavar="HOST:PORT",
                        help="the address other engines dial to reach the transfer engine, where it differs from "
                             "the listen address (NAT, a relay; default: the listen address)")
    parser.add_argument("--lease-s", type=float, default=60.0, help="how long a prefill keeps unpulled KV (default 60)")
    parser.add_argument("--pull-timeout-s", type=float, default=30.0, help="how long a decode waits for KV (default 30)")
    parser.add_argument("--served-model-name", default="pddcore-reference", help="the model name clients use")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="this engine's certificate: the transfer engine runs mutual TLS with certificates "
                             "(with --tls-key and --tls-ca; `pddcore certs` makes them); its common name is the "
                             "engine's name, and PDDCORE_AUTH_TOKEN is then optional")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="the deployment's CA certificate: peers' certificates must verify against it")


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from ..model import load_model
    from ..transfer import TransferEngine
    from .scheduler import Scheduler
    from .server import EngineServer
    from .sglang_server import SGLangEngineServer

    torch.set_num_threads(1)  # small ops on a shared CPU: extra threads only contend
    set_num_threads(1)
    model = load_model({"path": args.model, "seed": args.seed, "dtype": args.dtype})
    token = os.environ.get("PDDCORE_AUTH_TOKEN") or None
    transfer = TransferEngine(listen=args.transfer_listen or f"{args.host}:0", auth_token=token,
                              tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    scheduler = Scheduler(model, pool_pages=args.pool_pages, page_size=args.page_size, transfer=transfer,
                          engine_id=f"{args.role}-{uuid.uuid4().hex[:12]}", lease_s=args.lease_s,
                          pull_timeout_s=args.pull_timeout_s, advertise=args.transfer_advertise)
    server_class = SGLangEngineServer if args.dialect == "sglang" else EngineServer
    server = server_class(args.role, model, scheduler, model_name=args.served_model_name)

    async def serve() -> None:
        runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(json.dumps({"url": f"http://{args.host}:{port}", "transfer": transfer.address}), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        scheduler.close()
        transfer.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pddcore engine")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
