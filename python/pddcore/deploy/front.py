"""The front: the router in front of P, RLD and MD, and the one place that tracks each
request's life (route, output ownership, faults). Every process talks to it over a Unix
socket (these work across network namespaces); KV and handoffs never pass through it.

Per request: ask MD's radix cache how much of the context it holds (``lookup``), let
:class:`pddcore.router.Router` choose the pipeline (cross-DC PD mode: always ``P_MD``),
send P the job, then forward every output token to the client, checking that each
position arrives exactly once, in order, from the role that owns the output at that
moment (RLD before the final handoff, MD from it on).

Faults: MD's connection closing (MD killed) -> requests RLD still decodes stay there; a
request MD owned (or was about to own) is resumed on RLD: P prefills the context plus
the tokens the client already has (a prefix-cache hit) and RLD continues from there, so
nothing is lost. A P->MD transfer that fails or times out -> the request stays on RLD
(``P_MD`` ones are resumed on RLD). A rejected handoff is counted; RLD re-sends.

Measured on the way, for the run's summary: each request's prefill at P (tokens,
seconds), when its KV was usable at RLD (its first RLD token) and at MD (``md_ready``),
counted from the end of its prefill on the front's clock, and every decode step's
seconds and batch size at RLD and MD.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait

from ..router import BandwidthEstimator, Pipeline, RouteRequest, Router, RouterConfig

__all__ = ["serve"]

log = logging.getLogger("pddcore.deploy.front")


@dataclass
class _Request:
    rid: str
    context: list[int]
    max_new_tokens: int
    seed: int
    pipeline: Pipeline | None = None
    md_cached: int = 0
    delivered: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    handoff_at: int | None = None
    on_rld: bool = False
    done: bool = False
    resumed: bool = False
    md_dropped: bool = False


class Front:
    def __init__(self, config: dict):
        self.config = config
        self.mode = config["mode"]
        self.expected = {"P", "MD"} | ({"RLD"} if self.mode == "pdd" else set())
        self.listener = Listener(config["hub"], family="AF_UNIX", authkey=bytes.fromhex(config["authkey"]))
        self.new_conns: queue.Queue = queue.Queue()
        threading.Thread(target=self._accept, daemon=True).start()
        self.conns: dict[str, Connection] = {}
        self.hellos: dict[str, dict] = {}
        self.ready = False
        r = config["router"]
        self.router = Router(RouterConfig(kv_bytes_per_token=r["kv_bytes_per_token"], ttft_slo_s=r["ttft_slo_s"],
                                          rld_tpot_s=r["rld_tpot_s"], min_md_tokens=r.get("min_md_tokens", 16)))
        self.estimator = BandwidthEstimator(prior_bytes_per_s=r["prior_bytes_per_s"], prior_rtt_s=r["prior_rtt_s"],
                                            min_sample_bytes=256 << 10)
        self.rld_capacity = r.get("rld_capacity", 8)
        self.requests: dict[str, _Request] = {}
        self.md_alive = True
        self.counts: Counter = Counter()
        self.violations: list[str] = []
        self.rejections: list[str] = []
        self.wan_bytes = 0
        self.md_tokens = 0
        self.md_token_milestone = config.get("md_token_milestone")
        self.route_reasons: dict[str, str] = {}
        self.prefills: dict[str, tuple[int, float]] = {}  # rid -> (tokens prefilled, seconds), first prefill
        self.prefilled_at: dict[tuple[str, str], float] = {}  # (target, rid) -> end of the prefill, KV on its way
        self.kv_usable_s: dict[str, dict[str, float]] = {"rld": {}, "md": {}}  # target -> rid -> seconds
        self.decode_steps: dict[str, list[tuple[float, int]]] = {"RLD": [], "MD": []}  # (seconds, batch)

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            self.new_conns.put(conn)

    # ---- loop -----------------------------------------------------------------------------
    def serve(self) -> None:
        pending: list[Connection] = []
        while True:
            while not self.new_conns.empty():
                pending.append(self.new_conns.get())
            live = pending + list(self.conns.values())
            for conn in wait(live, timeout=0.02):
                name = next((n for n, c in self.conns.items() if c is conn), None)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if name is None:
                        pending.remove(conn)
                        continue
                    del self.conns[name]
                    if self.lost(name):
                        return
                    continue
                if name is None:
                    pending.remove(conn)
                    self.hello(conn, msg)
                else:
                    getattr(self, "on_" + msg[0])(name, *msg[1:])

    def send(self, name: str, *msg) -> None:
        conn = self.conns.get(name)
        if conn is not None:
            try:
                conn.send(msg)
            except OSError:
                pass

    def hello(self, conn: Connection, msg: tuple) -> None:
        _, role, info = msg
        self.conns[role] = conn
        self.hellos[role] = info
        if not self.ready and self.expected <= set(self.hellos):
            peers = {"md": (self.config["md_address"], self.hellos["MD"]["staging"])}
            if "RLD" in self.expected:
                peers["rld"] = (self.config["rld_address"], self.hellos["RLD"]["staging"])
            self.send("P", "peers", peers)
            self.ready = True
        if self.ready:
            for name in ("client", "ctl"):
                if name in self.conns and not self.hellos[name].get("told"):
                    self.hellos[name]["told"] = True
                    self.send(name, "ready")

    def lost(self, name: str) -> bool:
        """A process went away; True when the front should stop."""
        if name == "MD" and self.md_alive:
            self.md_lost()
            return False
        if name in ("ctl",):
            return True
        if name in ("P", "RLD"):
            log.error("%s exited; the deployment cannot go on", name)
            self.send("ctl", "failed", f"{name} exited")
            return True
        return False

    # ---- requests -------------------------------------------------------------------------
    def on_submit(self, _: str, rid: str, context: list[int], max_new_tokens: int, seed: int) -> None:
        req = self.requests[rid] = _Request(rid, list(context), max_new_tokens, seed)
        if self.md_alive:
            self.send("MD", "lookup", rid, req.context)
        else:
            self.dispatch(req, Pipeline.RLD_ONLY)

    def on_lookup_ok(self, _: str, rid: str, cached: int) -> None:
        req = self.requests[rid]
        req.md_cached = cached
        if self.mode == "pd":
            pipeline = Pipeline.P_MD
        else:
            link = self.estimator.estimate("md", now=time.monotonic())
            rld_load = sum(r.on_rld for r in self.requests.values()) / self.rld_capacity
            route = self.router.route(RouteRequest(
                prompt_tokens=len(req.context), md_cached_tokens=cached, wan_bytes_per_s=link.bytes_per_s,
                wan_rtt_s=link.rtt_s, max_output_tokens=req.max_new_tokens, rld_load=rld_load))
            pipeline = route.pipeline
            self.route_reasons[rid] = (f"{route.reason} (link estimate {link.bytes_per_s * 8 / 1e6:.0f} Mbit/s, "
                                       f"RTT {link.rtt_s * 1e3:.0f} ms)")
            if pipeline is Pipeline.RLD_ONLY:
                self.send("MD", "release", rid)
        self.dispatch(req, pipeline)

    def dispatch(self, req: _Request, pipeline: Pipeline) -> None:
        if pipeline is not Pipeline.P_MD and "RLD" not in self.expected:
            log.error("%s: no RLD in this deployment and MD is gone; the request is lost", req.rid)
            self.finish(req, "lost")
            return
        req.pipeline = pipeline
        req.on_rld = pipeline is not Pipeline.P_MD
        self.counts["resumed" if req.resumed else f"route_{pipeline.value}"] += 1
        targets = (["rld"] if req.on_rld else []) + (["md"] if pipeline is not Pipeline.RLD_ONLY else [])
        self.send("P", "job", {"rid": req.rid, "context": req.context + req.delivered,
                               "out_index": len(req.delivered), "max_new_tokens": req.max_new_tokens,
                               "seed": req.seed, "pipeline": pipeline.value, "targets": targets,
                               "md_cached": req.md_cached})

    def on_tokens(self, role: str, _: str, events: list, step_s: float | None = None) -> None:
        if step_s is not None:
            self.decode_steps[role].append((step_s, len(events)))
        forward = []
        for rid, index, token in events:
            req = self.requests[rid]
            if role == "RLD":
                self.kv_landed("rld", rid)
            owner_ok = (role == "RLD") == (req.handoff_at is None or index < req.handoff_at) \
                if req.pipeline is Pipeline.P_RLD_MD and not req.resumed else True
            if index != len(req.delivered) or not owner_ok or req.done:
                self.violations.append(f"{rid}: token {index} from {role} (have {len(req.delivered)}, "
                                       f"handoff at {req.handoff_at})")
                continue
            req.delivered.append(token)
            req.sources.append(role)
            forward.append((rid, index, token, role))
        self.send("client", "tokens", forward)
        if role == "MD":
            self.md_tokens += len(forward)
            if self.md_token_milestone is not None and self.md_tokens >= self.md_token_milestone:
                self.md_token_milestone = None
                self.send("ctl", "md_milestone")  # fault injection: the supervisor kills MD now

    def on_handoff(self, _: str, rid: str, index: int, mode: str) -> None:
        req = self.requests[rid]
        req.handoff_at, req.on_rld = index, False
        self.counts[f"handoff_{mode}"] += 1

    def on_took_over(self, _: str, rid: str, index: int) -> None:
        if self.requests[rid].handoff_at != index:
            self.violations.append(f"{rid}: MD took over at {index}, RLD handed off at "
                                   f"{self.requests[rid].handoff_at}")
        self.send("RLD", "released", rid)

    def on_done(self, role: str, rid: str, _: str) -> None:
        req = self.requests[rid]
        if req.pipeline is Pipeline.P_RLD_MD and role == "RLD" and req.handoff_at is None and not req.resumed \
                and not req.md_dropped and self.md_alive:
            # Finished on RLD before any handoff. The KV for MD is mostly on the wire already:
            # MD keeps it in its radix cache, so the session's next turn is a high-hit P_MD one.
            self.send("MD", "cache_only", rid)
            self.counts["md_cache_only_rld_finished"] += 1
        self.finish(req, role)

    def finish(self, req: _Request, by: str) -> None:
        req.done, req.on_rld = True, False
        self.counts[f"finished_{by}"] += 1
        self.send("client", "done", req.rid, by)
        self.send("ctl", "progress", sum(r.done for r in self.requests.values()))

    def on_xfer(self, _: str, rid: str, target: str, status: str, nbytes: int, link: dict) -> None:
        if target == "md":
            self.wan_bytes += nbytes
            self.counts[f"md_transfer_{status}"] += 1
            if link:  # goodput while busy and RTT, as P's engine measured them
                self.estimator.update_from_stats({"peers": {"md": link}}, now=time.monotonic())
        req = self.requests[rid]
        if status == "done" or status == "cancelled" or req.done or not self.md_alive:
            return
        if target == "md" and req.pipeline is Pipeline.P_RLD_MD and req.handoff_at is None:
            log.warning("%s: transfer to MD %s; the request stays on RLD", rid, status)
            self.counts["stayed_on_rld_after_md_" + status] += 1
            req.md_dropped = True
            self.send("RLD", "stay", rid)
            self.send("MD", "release", rid)
        elif target == "md" and req.pipeline is Pipeline.P_MD:
            self.send("MD", "release", rid)
            self.resume(req)
        else:
            log.error("%s: transfer to %s %s", rid, target, status)

    def on_md_ready(self, _: str, rid: str) -> None:
        self.counts["md_ready"] += 1
        self.kv_landed("md", rid)

    def on_prefilled(self, _: str, rid: str, p_cached: int, seconds: float) -> None:
        req = self.requests[rid]
        self.counts["p_prefill_tokens"] += len(req.context) - p_cached
        self.counts["p_cached_tokens"] += p_cached
        self.prefills.setdefault(rid, (len(req.context) - p_cached, seconds))
        now = time.monotonic()
        if req.on_rld:
            self.prefilled_at["rld", rid] = now
        if req.pipeline is not Pipeline.RLD_ONLY:
            self.prefilled_at["md", rid] = now

    def kv_landed(self, target: str, rid: str) -> None:
        """``rid``'s KV is usable at ``target``: record how long after its prefill."""
        sent = self.prefilled_at.pop((target, rid), None)
        if sent is not None:
            self.kv_usable_s[target].setdefault(rid, time.monotonic() - sent)

    def on_rejected(self, _: str, reason: str) -> None:
        self.rejections.append(reason)
        self.counts["handoff_rejected"] += 1

    def on_staging_free(self, _: str, target: str, offset: int) -> None:
        self.send("P", "staging_free", target, offset)

    def on_summary(self, _: str) -> None:
        self.send("ctl", "summary", {"counts": dict(self.counts), "violations": self.violations,
                                     "rejections": self.rejections, "wan_bytes": self.wan_bytes,
                                     "md_alive": self.md_alive,
                                     "sources": {rid: r.sources for rid, r in self.requests.items()},
                                     "pipelines": {rid: r.pipeline.value if r.pipeline else None
                                                   for rid, r in self.requests.items()},
                                     "md_cached": {rid: r.md_cached for rid, r in self.requests.items()},
                                     "route_reasons": self.route_reasons, "prefills": self.prefills,
                                     "kv_usable_s": self.kv_usable_s, "decode_steps": self.decode_steps})

    # ---- faults ---------------------------------------------------------------------------
    def md_lost(self) -> None:
        log.warning("MD is gone: its requests finish on RLD")
        self.md_alive = False
        self.counts["md_lost"] += 1
        self.send("P", "md_lost")
        self.send("RLD", "md_lost")
        for req in self.requests.values():
            if req.done:
                continue
            if req.pipeline is None:
                self.dispatch(req, Pipeline.RLD_ONLY)
            elif req.pipeline is Pipeline.P_RLD_MD and req.handoff_at is None and not req.resumed:
                self.counts["md_lost_stayed_on_rld"] += 1
            elif req.pipeline is not Pipeline.RLD_ONLY:
                self.resume(req)

    def resume(self, req: _Request) -> None:
        """Continues ``req`` on RLD from the tokens the client already has."""
        req.handoff_at = None
        req.resumed = True
        if len(req.delivered) >= req.max_new_tokens:
            self.finish(req, "MD")
            return
        self.counts["md_lost_resumed_on_rld" if not self.md_alive else "md_failed_resumed_on_rld"] += 1
        self.dispatch(req, Pipeline.RLD_ONLY)


def serve(config: dict) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s front %(levelname)s %(message)s")
    Front(config).serve()
