"""The `pddcore` command. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "info": ("pddcore.info", "show version, compiled parts and usable devices"),
    "demo": ("pddcore.deploy.cli", "run the reference PDD deployment: cross-DC PD vs PDD on an emulated WAN"),
    "wan": ("pddcore.testing.wan_cli", "emulated WAN link between two network namespaces (up, down, status)"),
    "bench": ("pddcore.benchmarks.cli", "microbenchmarks with ratios to in-run baselines, results.json and plots"),
    "sim": ("pddcore.sim.cli", "cluster simulator and cost model: same-DC PD vs cross-DC PD vs PDD"),
    "serve": ("pddcore.serve.cli", "OpenAI-compatible PDD gateway in front of prefill, relay and main decode engines"),
    "engine": ("pddcore.engine.cli", "reference engine server (vLLM's HTTP dialect) over the CPU reference model"),
    "token": ("pddcore.token_cli", "print a new 256-bit auth token (hex) for the engines' auth_token / PDDCORE_AUTH_TOKEN"),
    "certs": ("pddcore.certs_cli", "make a deployment CA and engine certificates for TLS with certificates"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pddcore", description="PDD disaggregation toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
