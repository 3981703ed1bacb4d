"""The PDD report's handoff microbenchmark: hand 100 decoded tokens from RLD to MD
across a loaded WAN, (a) as their KV or (b) as their token ids plus one extend pass.

Three processes share one :class:`~pddcore.testing.wan.WanLink` (needs root):

- **P** (namespace a) keeps the a -> b direction busy: a :class:`~pddcore.TransferEngine`
  writes a 32 MiB region to MD over and over, two transfers in flight, as the KV of
  other requests would.
- **RLD** (namespace a) holds a prefix plus the 100 tokens in its paged pool and runs
  the trials, alternating the two paths so both see the same load:

  (a) ``pddcore.pack`` the 100 tokens' pages, ``TransferEngine.write`` them into MD's
      registered buffer (``notify`` arrives once every byte was verified and applied),
      MD ``pddcore.unpack``\\ s them into fresh pages after its cached prefix;
  (b) ``Handoff.encode`` the token ids (plus sampler state) and ``send`` them on the
      priority lane; MD decodes the message and runs one ``Model.extend`` over them.

- **MD** (namespace b) holds the prefix (its prefill stands in for the KV P shipped
  earlier), applies each handoff, stamps the time and acknowledges, so trials never
  overlap.

Latency of a trial = MD's time stamp after the KV is in its pool - RLD's time stamp
before it started packing / encoding (both namespaces share CLOCK_MONOTONIC). The first
(b) trial also checks that the recomputed KV equals the shipped KV (float64: to rounding).

Model configurations (``MODELS``): ``embedded`` is the reference model's default
(4 layers, 2 KV heads x 64, float64: 8 KiB of KV per token, 800 KiB for 100 tokens);
``report_kv`` is a wider random model (8 layers, 6 KV heads x 64, float64: 48 KiB per
token, 4.8 MiB for 100 tokens) whose KV per token matches the report's ~46.5 KB, so
path (a) moves the report's bytes with real pages and path (b) pays a proportionally
larger recompute. Both run on this machine's CPU (``torch.set_num_threads(1)``); the
report's numbers come from a large model on GPUs.
"""

from __future__ import annotations

import os
import random
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .._stats import percentiles
from ..model import ModelConfig
from .auth import bench_token
from .sink import desc_address, read_info, write_info

MODELS: dict[str, ModelConfig] = {
    "embedded": ModelConfig(),
    "report_kv": ModelConfig(num_layers=8, hidden_size=384, num_heads=6, num_kv_heads=6, head_dim=64,
                             intermediate_size=1024),
}

# The PDD report's figures for a 100-token handoff (what our numbers are set beside).
REPORT = {
    "kv": {"payload_bytes": 4649 * 1024, "mean_ms": 185.0, "max_ms": 512.6},
    "ids": {"payload_bytes": 1536, "mean_ms": 305.0, "max_ms": 321.4, "std_ms": 4.8},
}

PAGE_SIZE = 4  # 100 tokens after a page-aligned prefix fill exactly 25 pages: no partial page shipped
BULK_BYTES = 32 << 20
_KV_NOTE = struct.Struct("<2sI")  # b"kv", trial
_ACK = struct.Struct("<3sI")  # b"ack", trial
_MD_PORT, _RLD_PORT = 9510, 9511


def bench_model(config_name: str, dtype=None):
    """The seeded model of ``MODELS[config_name]`` in ``dtype`` (None: float64), on one thread."""
    import torch

    from ..model import Model

    torch.set_num_threads(1)  # tiny ops: more OpenMP threads only contend on a small CPU
    return Model.default(seed=0, config=MODELS[config_name], dtype=dtype or torch.float64)


def _prompt(prefix_len: int, vocab: int) -> list[int]:
    return [(31 * i + 7) % vocab for i in range(prefix_len)]


def handoff_tokens(tokens: int, vocab: int) -> list[int]:
    """The ids RLD "decoded"; which ids they are does not change the cost of either path."""
    return [(17 * i + 5) % vocab for i in range(tokens)]


# ---- MD (namespace b) ------------------------------------------------------------------


def main_decode(config_name: str, prefix_len: int, tokens: int, info_path: str, listen: str, exit_path: str) -> dict:
    """Receives handoffs until ``exit_path`` exists; returns per-trial arrival stamps and the KV check."""
    import torch

    import pddcore
    from pddcore.handoff import Handoff
    from pddcore.transfer import TransferEngine

    model = bench_model(config_name)
    pool = model.new_pool(num_pages=(prefix_len + 4 * tokens) // PAGE_SIZE + 8, page_size=PAGE_SIZE)
    layout = pool.layout()
    prefix = pool.new_sequence()
    model.prefill([prefix], [_prompt(prefix_len, model.config.vocab_size)])
    kv_buf = torch.zeros(layout.packed_nbytes(tokens // PAGE_SIZE), dtype=torch.uint8)
    done: dict[int, tuple[float, float]] = {}  # trial -> (message seen, KV in the pool)
    check: dict = {}
    with TransferEngine(listen=listen, auth_token=bench_token()) as engine:
        kv_region = engine.register(kv_buf, target=True)
        bulk_region = engine.register(torch.zeros(BULK_BYTES, dtype=torch.uint8), target=True)
        write_info(info_path, f"{kv_region.descriptor().hex()} {bulk_region.descriptor().hex()}")
        rld = None
        while not os.path.exists(exit_path):
            for sender, _, message, _ in engine.poll_messages(timeout=0.2):
                seen = time.monotonic()
                if message == b"hello":
                    rld = engine.connect(sender)
                    engine.send(rld, b"ready")
                    continue
                seq = pool.fork(prefix)
                if len(message) == _KV_NOTE.size and message[:2] == b"kv":
                    trial = _KV_NOTE.unpack(message)[1]
                    pages = pool.append_external(seq, tokens)
                    pddcore.unpack(layout, torch.tensor(pages, dtype=torch.int64), kv_buf)
                else:
                    msg = Handoff.decode(message)
                    trial = int(msg.request_id[1:])
                    model.extend([seq], [list(msg.token_ids)])
                done[trial] = (seen, time.monotonic())
                if not check and message[:2] != b"kv":
                    # Shipped bytes (still in kv_buf from the preceding (a) trial) vs recomputed pages.
                    recomputed = pddcore.pack(layout, torch.tensor(seq.pages[prefix_len // PAGE_SIZE:]))
                    diff = (recomputed.view(model.dtype) - kv_buf.view(model.dtype)).abs().max().item()
                    check["max_abs_diff"] = diff
                    check["max_abs_kv"] = kv_buf.view(model.dtype).abs().max().item()
                pool.release(seq)
                engine.send(rld, _ACK.pack(b"ack", trial))
    return {"arrived": done, "check": check}


# ---- P: background bulk (namespace a) ----------------------------------------------------


def bulk_sender(info_path: str, stop_path: str) -> dict:
    """Writes MD's bulk region again and again, two transfers in flight, until ``stop_path`` exists."""
    import torch

    from pddcore.transfer import TransferEngine

    bulk_desc = bytes.fromhex(read_info(info_path).split()[1])
    with TransferEngine(streams=4, chunk_bytes=1 << 20, auth_token=bench_token()) as engine:
        src = engine.register(torch.randint(0, 256, (BULK_BYTES,), dtype=torch.uint8))
        peer = engine.connect(desc_address(bulk_desc))
        start = time.monotonic()
        in_flight = [engine.write(peer, src, 0, bulk_desc, 0, BULK_BYTES)]
        while not os.path.exists(stop_path):
            in_flight.append(engine.write(peer, src, 0, bulk_desc, 0, BULK_BYTES))
            in_flight.pop(0).wait()
        for t in in_flight:
            t.cancel()
        sent = engine.stats()["bytes_sent"]
        return {"bytes": sent, "seconds": time.monotonic() - start}


# ---- RLD (namespace a) -----------------------------------------------------------------


def relay_decode(config_name: str, prefix_len: int, tokens: int, trials: int, info_path: str,
                 listen: str, seed: int) -> dict:
    """Runs ``trials`` handoffs of each kind, alternating; returns start stamps and payload sizes."""
    import torch

    import pddcore
    from pddcore.handoff import FINAL, Handoff, SamplerState
    from pddcore.transfer import TransferEngine

    model = bench_model(config_name)
    pool = model.new_pool(num_pages=(prefix_len + tokens) // PAGE_SIZE + 8, page_size=PAGE_SIZE)
    layout = pool.layout()
    seq = pool.new_sequence()
    vocab = model.config.vocab_size
    ids = handoff_tokens(tokens, vocab)
    model.prefill([seq], [_prompt(prefix_len, vocab)])
    model.extend([seq], [ids])  # the KV RLD's decode steps left in its pool
    ship = torch.tensor(seq.pages[prefix_len // PAGE_SIZE:], dtype=torch.int64)
    kv_desc = bytes.fromhex(read_info(info_path).split()[0])
    buf = torch.empty(layout.packed_nbytes(len(ship)), dtype=torch.uint8)
    order = [kind for _ in range(trials) for kind in ("kv", "ids")]
    sampler = SamplerState(seed=1234, rng_offset=tokens, num_generated=tokens)
    rng = random.Random(seed)
    started: dict[int, float] = {}
    with TransferEngine(listen=listen, auth_token=bench_token()) as engine:
        src = engine.register(buf)
        md = engine.connect(desc_address(kv_desc))
        engine.send(md, b"hello")
        await_message(engine, b"ready")
        sizes = {}
        for trial, kind in enumerate(order):
            time.sleep(rng.uniform(0.02, 0.06))  # no phase lock with the bulk flows
            t0 = time.monotonic()
            transfer = None
            if kind == "kv":
                pddcore.pack(layout, ship, out=buf)
                transfer = engine.write(md, src, 0, kv_desc, 0, buf.numel(), notify=_KV_NOTE.pack(b"kv", trial))
                sizes["kv"] = buf.numel()
            else:
                message = Handoff(f"t{trial}", seq=0, start_pos=prefix_len, token_ids=ids, flags=FINAL,
                                  sampler_state=sampler).encode()
                engine.send(md, message)
                sizes["ids"] = len(message)
            started[trial] = t0
            await_message(engine, _ACK.pack(b"ack", trial))
            if transfer is not None:
                transfer.wait()  # done before MD's ack; raises if the write failed
        stats = engine.stats()["peers"][md.address]
    return {"started": started, "kinds": order, "payload_bytes": sizes, "rtt_s": stats["rtt_s"]}


def await_message(engine, expected: bytes, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m.payload == expected for m in engine.poll_messages(timeout=1.0)):
            return
    raise TimeoutError(f"MD did not answer {expected!r} within {timeout:.0f} s")


# ---- the case ---------------------------------------------------------------------------


@dataclass
class PathStats:
    """One path's latency distribution (milliseconds) and payload. A trial's latency is
    ``transport`` (RLD starts until MD sees the notification / message: pack and wire
    time) plus ``apply`` (MD's unpack / extend)."""

    payload_bytes: int
    samples_ms: list[float]
    transport_ms: list[float]

    @property
    def summary(self) -> dict:
        s, t = np.asarray(self.samples_ms), np.asarray(self.transport_ms)
        apply = s - t
        total, transport, applied = percentiles(s, (50, 99)), percentiles(t, (99,)), percentiles(apply, (99,))
        return {"payload_bytes": self.payload_bytes, "trials": len(s), "mean_ms": float(s.mean()),
                "p50_ms": total[50], "p99_ms": total[99], "max_ms": float(s.max()), "std_ms": float(s.std(ddof=1)),
                "transport_mean_ms": float(t.mean()), "transport_p99_ms": transport[99],
                "apply_mean_ms": float(apply.mean()), "apply_p99_ms": applied[99]}


@dataclass
class HandoffResult:
    model: str
    kv_bytes_per_token: int
    tokens: int
    prefix_len: int
    rate_bps: int | None
    rtt_ms: float
    background_bulk: bool
    bulk_gbps: float
    kv: PathStats
    ids: PathStats
    max_abs_kv_diff: float  # recomputed (b) vs shipped (a) KV: the two paths leave the same state
    engine_rtt_ms: float  # the priority lane's smoothed RTT as TransferEngine.stats() saw it
    report: dict = field(default_factory=lambda: REPORT)

    def ratios(self) -> dict:
        """Token-id path over KV path (below 1: the token-id path is better)."""
        a, b = self.kv.summary, self.ids.summary
        return {f"ids_over_kv_{k}": b[k] / a[k] for k in ("payload_bytes", "mean_ms", "p99_ms", "max_ms", "std_ms")}

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv"] = {**self.kv.summary, **asdict(self.kv)}
        d["ids"] = {**self.ids.summary, **asdict(self.ids)}
        return {**d, **self.ratios()}


def handoff_case(model: str = "embedded", *, trials: int = 50, tokens: int = 100, prefix_len: int = 512,
                 rate: str | int | None = "1gbit", delay_ms: float = 10.0, background_bulk: bool = True,
                 seed: int = 0) -> HandoffResult:
    """Runs ``trials`` handoffs of each kind through a fresh WanLink; see the module docstring."""
    from ..testing.wan import WanLink

    config = MODELS[model]
    if tokens % PAGE_SIZE or prefix_len % PAGE_SIZE:
        raise ValueError(f"tokens ({tokens}) and prefix_len ({prefix_len}) must be multiples of {PAGE_SIZE}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        info, stop, md_exit = (os.path.join(tmp, name) for name in ("md", "stop", "exit"))
        md = link.b.spawn(main_decode, model, prefix_len, tokens, info, f"{link.b.address}:{_MD_PORT}", md_exit)
        read_info(info, timeout=120)
        bulk = link.a.spawn(bulk_sender, info, stop) if background_bulk else None
        if bulk is not None:
            time.sleep(1.0)  # let the bulk flows fill the pipe and the bottleneck queue
        try:
            sent = link.a.call(relay_decode, model, prefix_len, tokens, trials, info,
                               f"{link.a.address}:{_RLD_PORT}", seed, timeout=60 + trials * 20)
        finally:
            write_info(stop, "")
            bulk_out = bulk.result(60) if bulk is not None else {"bytes": 0, "seconds": 1.0}
            write_info(md_exit, "")  # after the bulk sender: MD's engine outlives every transfer
        received = md.result(60)
        rate_bps, rtt_ms = link.rate_bps, link.rtt_ms
    arrived = received["arrived"]
    lat, wire = {"kv": [], "ids": []}, {"kv": [], "ids": []}
    for trial, kind in enumerate(sent["kinds"]):
        seen, applied = arrived[trial]
        lat[kind].append(1000 * (applied - sent["started"][trial]))
        wire[kind].append(1000 * (seen - sent["started"][trial]))
    kv_per_token = 2 * config.num_layers * config.kv_size * 8  # K and V, float64
    return HandoffResult(
        model=model, kv_bytes_per_token=kv_per_token, tokens=tokens, prefix_len=prefix_len, rate_bps=rate_bps,
        rtt_ms=rtt_ms, background_bulk=background_bulk, bulk_gbps=bulk_out["bytes"] * 8 / bulk_out["seconds"] / 1e9,
        kv=PathStats(sent["payload_bytes"]["kv"], lat["kv"], wire["kv"]),
        ids=PathStats(sent["payload_bytes"]["ids"], lat["ids"], wire["ids"]),
        max_abs_kv_diff=received["check"]["max_abs_diff"], engine_rtt_ms=1000 * sent["rtt_s"])


def format_handoff(r: HandoffResult) -> str:
    """The two paths side by side with the report's figures."""
    head = (f"handoff of {r.tokens} tokens, model '{r.model}' ({r.kv_bytes_per_token / 1024:.0f} KiB KV/token), "
            f"{(r.rate_bps or 0) / 1e9:.1f} Gbit/s RTT {r.rtt_ms:.0f} ms, "
            + (f"background bulk {r.bulk_gbps:.2f} Gbit/s" if r.background_bulk else "idle link"))
    lines = [head, f"  {'path':<22}{'payload':>10}{'mean ms':>9}{'p99 ms':>9}{'max ms':>9}{'std ms':>8}"
                   f"   transport mean/p99 + apply mean/p99 ms"]
    rows = [("(a) KV, here", r.kv.summary), ("(a) KV, report", r.report["kv"]),
            ("(b) token ids, here", r.ids.summary), ("(b) token ids, report", r.report["ids"])]
    for name, s in rows:
        fmt = lambda k: f"{s[k]:.1f}" if k in s else "-"  # noqa: E731
        parts = (f"   {s['transport_mean_ms']:.1f}/{s['transport_p99_ms']:.1f} + {s['apply_mean_ms']:.1f}/"
                 f"{s['apply_p99_ms']:.1f}" if "transport_mean_ms" in s else "")
        lines.append(f"  {name:<22}{s['payload_bytes'] / 1024:>8.1f}KB{fmt('mean_ms'):>9}{fmt('p99_ms'):>9}"
                     f"{fmt('max_ms'):>9}{fmt('std_ms'):>8}{parts}")
    q = r.ratios()
    lines.append(f"  (b)/(a): payload {q['ids_over_kv_payload_bytes']:.1e}x, mean {q['ids_over_kv_mean_ms']:.2f}x, "
                 f"p99 {q['ids_over_kv_p99_ms']:.2f}x, max {q['ids_over_kv_max_ms']:.2f}x, "
                 f"std {q['ids_over_kv_std_ms']:.2f}x; recomputed vs shipped KV max |diff| {r.max_abs_kv_diff:.1e}")
    return "\n".join(lines)
