"""`pddcore wan up|down|status`: an emulated WAN link that stays up between commands.

    pddcore wan up --rate 1gbit --delay-ms 25          # link "wan0": RTT 50 ms
    ip netns exec pddwan-wan0-b iperf3 -s &             # anything, in either namespace
    ip netns exec pddwan-wan0-a iperf3 -c 10.201.2.1
    pddcore wan status
    pddcore wan down
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from . import delay_line, wan, wan_registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="wan_command", required=True)
    up = sub.add_parser("up", help="create a link that stays up until `pddcore wan down`")
    up.add_argument("--name", default="wan0", help="link name, [a-z0-9]{1,20} (default: wan0)")
    up.add_argument("--rate", default="1gbit", help="bandwidth per direction, tc style (default: 1gbit; 'none': no cap)")
    up.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay in ms (default: 25)")
    up.add_argument("--jitter-ms", type=float, default=0.0, help="bounded, order-preserving jitter in ms (default: 0)")
    up.add_argument("--loss", type=float, default=0.0, help="random loss probability per packet (default: 0)")
    up.add_argument("--mtu", type=int, default=1500, help="MTU of every device on the path (default: 1500)")
    up.add_argument("--buffer-ms", type=float, default=None, help="bottleneck queue in ms at line rate")
    up.add_argument("--seed", type=int, default=None, help="seed for jitter and loss draws")
    up.add_argument("--no-offload", action="store_true",
                    help="move every MTU-sized packet through the delay line on its own (default with --loss)")
    down = sub.add_parser("down", help="remove a link")
    down.add_argument("--name", default="wan0", help="link name (default: wan0)")
    down.add_argument("--all", action="store_true", help="remove every pddcore WAN link on this machine")
    status = sub.add_parser("status", help="show links, their settings and delay-line counters")
    status.add_argument("--name", default=None, help="only this link")
    status.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status}[args.wan_command](args)


def _up(args: argparse.Namespace) -> int:
    rate = None if args.rate.lower() == "none" else args.rate
    link = wan.WanLink(rate, args.delay_ms, args.jitter_ms, args.loss, mtu=args.mtu, buffer_ms=args.buffer_ms,
                       seed=args.seed, name=args.name, offload=False if args.no_offload else None)
    link.open(detach=True)
    rate = f"{link.rate_bps / 1e6:g} Mbit/s" if link.rate_bps else "uncapped"
    print(f"WAN link {link.name} up: {rate}, delay {link.delay_ms:g} ms (RTT {link.rtt_ms:g} ms), "
          f"jitter {link.jitter_ms:g} ms, loss {link.loss:g}")
    print(f"  a: {link.a.address} in namespace {link.a.netns}")
    print(f"  b: {link.b.address} in namespace {link.b.netns}")
    print(f"  run a command: ip netns exec {link.a.netns} <command>")
    print(f"  remove it:     pddcore wan down --name {link.name}")
    return 0


def _down(args: argparse.Namespace) -> int:
    names = wan_registry.list_links() if args.all else [args.name]
    if not args.all and args.name not in wan_registry.list_links():
        print(f"no WAN link named {args.name!r}")
        return 1
    for name in names:
        wan_registry.teardown(name)
        print(f"{name}: down")
    return 0


def _describe(name: str) -> dict:
    state = wan_registry.read_state(name) or {}
    info = {"name": name, "alive": wan_registry.link_alive(name), **{k: v for k, v in state.items() if k != "name"}}
    try:
        info["stats"] = asdict(delay_line.read_stats(wan_registry.stats_path(name)))
    except (OSError, ValueError):
        info["stats"] = None
    return info


def _status(args: argparse.Namespace) -> int:
    names = [args.name] if args.name else wan_registry.list_links()
    if args.name and args.name not in wan_registry.list_links():
        print(f"no WAN link named {args.name!r}")
        return 1
    links = [_describe(n) for n in names]
    if args.json:
        print(json.dumps(links, indent=2))
        return 0
    if not links:
        print("no WAN links")
    for link in links:
        rate = f"{link['rate_bps'] / 1e6:g} Mbit/s" if link.get("rate_bps") else "uncapped"
        print(f"{link['name']}: {'up' if link['alive'] else 'STALE (owner gone; pddcore wan down removes it)'}, "
              f"{rate}, delay {link.get('delay_ms', '?')} ms, jitter {link.get('jitter_ms', '?')} ms, "
              f"loss {link.get('loss', '?')}")
        if link.get("addresses"):
            print(f"  a: {link['addresses']['a']} in {link['namespaces'][0]}   "
                  f"b: {link['addresses']['b']} in {link['namespaces'][2]}")
        if link["stats"]:
            for direction in ("a_to_b", "b_to_a"):
                s = link["stats"][direction]
                print(f"  {direction}: forwarded {s['forwarded_packets']} pkts / {s['forwarded_bytes']} B, "
                      f"lost {s['dropped_loss']}, overflow {s['dropped_overflow']}, "
                      f"queue {s['queue_packets']} pkts (max {s['max_queue_packets']})")
    return 0
