"""Layer-wise streaming over the WAN: how long after the end of P's prefill MD holds the KV.

Two processes share one :class:`~pddcore.testing.wan.WanLink` (needs root):

- **P** (namespace a) prefills a document with the reference model and ships its KV to MD
  with a :class:`~pddcore.streaming.LayerStreamSender`, one post per layer, either
  *streamed* (each layer packed and posted from ``Model.prefill(on_layer=...)``, while the
  later layers still compute) or *after prefill* (the same posts once prefill returned).
  Trials alternate the two modes.
- **MD** (namespace b) feeds its notifications to a
  :class:`~pddcore.streaming.LayerStreamReceiver`, unpacks each layer into its own pool as
  it lands, and stamps the time the last layer was applied.

The number per trial: MD's stamp - P's stamp right after prefill returned (both namespaces
share CLOCK_MONOTONIC). After prefill, that is the whole transfer; streamed, only what the
link could not move while prefill ran. The prefill time and the transfer time at line
rate are reported beside it, and per mode the link rate the router would read from P's
engine over those trials: bytes over busy time, and the path-limited counters
(``path_limited_bytes`` / ``path_limited_seconds``).
"""

from __future__ import annotations

import os
import statistics
import struct
import tempfile
import time
from dataclasses import dataclass

from .auth import bench_token
from .handoff_cases import MODELS, bench_model
from .results import Result
from .sink import desc_address, read_info, write_info

PAGE_SIZE = 16
MODES = ("streamed", "after_prefill")
_MD_PORT = 9530
_KEY = struct.Struct("<6sI")  # b"trial-", trial
_WARM_UP = 0xFFFF_FFFF  # an untimed first stream opens the data connections


@dataclass
class StreamResult(Result):
    model: str
    tokens: int
    kv_bytes: int
    rate_bps: float
    rtt_ms: float
    prefill_ms: list[float]
    streamed_ms: list[float]        # prefill end -> last layer applied at MD
    after_prefill_ms: list[float]
    # per mode: {"busy_bps": bytes over busy time, "path_limited_bps": the path-limited
    # counters' ratio (0: never path-limited), "path_limited_seconds": the time it covers},
    # from P's engine over that mode's trials
    link_readings: dict[str, dict[str, float]]

    @property
    def line_rate_ms(self) -> float:
        """The KV's bytes at the link's rate plus one one-way delay: the floor after prefill."""
        return self.kv_bytes * 8 / self.rate_bps * 1e3 + self.rtt_ms / 2

    @property
    def streamed_median_ms(self) -> float:
        return statistics.median(self.streamed_ms)

    @property
    def after_prefill_median_ms(self) -> float:
        return statistics.median(self.after_prefill_ms)

    @property
    def prefill_median_ms(self) -> float:
        return statistics.median(self.prefill_ms)


def _document(tokens: int, vocab: int) -> list[int]:
    return [(37 * i + 11) % vocab for i in range(tokens)]


def main_decode(config_name: str, tokens: int, trials: int, info_path: str, listen: str) -> dict[int, float]:
    """Namespace b: applies each trial's layers as they land; returns trial -> time of the last."""
    import torch

    import pddcore
    from pddcore.streaming import LayerStreamReceiver
    from pddcore.transfer import TransferEngine

    model = bench_model(config_name)
    pool = model.new_pool(num_pages=-(-tokens // PAGE_SIZE) + 1, page_size=PAGE_SIZE)
    seq = pool.allocate_sequence(tokens)
    layout, pages = pool.layout(), torch.tensor(seq.pages)
    per_layer = layout.packed_nbytes(len(seq.pages), [0], None)
    staging = torch.zeros(per_layer * model.config.num_layers, dtype=torch.uint8)
    receiver = LayerStreamReceiver()
    unpacked: dict[bytes, set[int]] = {}  # per stream: layers already in the pool
    applied: dict[int, float] = {}
    with TransferEngine(listen=listen, auth_token=bench_token()) as engine:
        region = engine.register(staging, target=True)
        write_info(info_path, region.descriptor().hex())
        while len(applied) < trials:
            for message in engine.poll_messages(timeout=0.5):
                progress = receiver.feed(message)
                if progress is None:
                    continue
                done = unpacked.setdefault(progress.key, set())
                for layer, landed in enumerate(progress.layers_landed):
                    if landed and layer not in done:
                        pddcore.unpack(layout, pages, staging[layer * per_layer:(layer + 1) * per_layer],
                                       layers=[layer])
                        done.add(layer)
                if progress.complete:
                    trial = _KEY.unpack(progress.key)[1]
                    if trial != _WARM_UP:
                        applied[trial] = time.monotonic()
    return applied


def prefill(config_name: str, tokens: int, trials: int, info_path: str) -> dict:
    """Namespace a: runs the trials; returns P's stamps and prefill times."""
    import torch

    import pddcore
    from pddcore.streaming import LayerStreamSender
    from pddcore.transfer import TransferEngine

    model = bench_model(config_name)
    pool = model.new_pool(num_pages=-(-tokens // PAGE_SIZE) + 1, page_size=PAGE_SIZE)
    document = _document(tokens, model.config.vocab_size)
    layers = model.config.num_layers
    desc = bytes.fromhex(read_info(info_path))
    stamps = {"prefill_end": {}, "prefill_s": {}, "mode": {}}
    counted = {mode: dict.fromkeys(_LINK_COUNTERS, 0.0) for mode in MODES}
    with TransferEngine(auth_token=bench_token()) as engine:
        peer = engine.connect(desc_address(desc))
        send = None
        for trial in [_WARM_UP, *range(trials)]:
            mode = "after_prefill" if trial == _WARM_UP else MODES[trial % 2]
            seq = pool.new_sequence()
            pool.reserve([seq], [tokens])
            layout, pages = pool.layout(), torch.tensor(seq.pages)
            per_layer = layout.packed_nbytes(len(seq.pages), [0], None)
            if send is None:
                send_buf = torch.zeros(per_layer * layers, dtype=torch.uint8)
                send = engine.register(send_buf)
            stream = LayerStreamSender(engine, peer, _KEY.pack(b"trial-", trial), layers)

            def post(layer: int) -> None:
                pddcore.pack(layout, pages, layers=[layer], out=send_buf[layer * per_layer:(layer + 1) * per_layer])
                stream.post(layer, [(send, layer * per_layer, desc, layer * per_layer, per_layer)])

            before = engine.stats()["peers"][peer.address]
            start = time.monotonic()
            model.prefill([seq], [document], on_layer=post if mode == "streamed" else None)
            end = time.monotonic()
            if mode == "after_prefill":
                for layer in range(layers):
                    post(layer)
            stream.wait(timeout=600)
            if trial != _WARM_UP:
                stamps["prefill_end"][trial], stamps["prefill_s"][trial], stamps["mode"][trial] = end, end - start, mode
                after = engine.stats()["peers"][peer.address]
                for name in _LINK_COUNTERS:
                    counted[mode][name] += after.get(name, 0.0) - before.get(name, 0.0)
            pool.release(seq)
            time.sleep(0.2)  # the link drains between trials
    stamps["link_readings"] = {mode: {"busy_bps": _ratio_bps(c["bytes_sent"], c["seconds_busy"]),
                                      "path_limited_bps": _ratio_bps(c["path_limited_bytes"], c["path_limited_seconds"]),
                                      "path_limited_seconds": c["path_limited_seconds"]}
                               for mode, c in counted.items()}
    return stamps


_LINK_COUNTERS = ("bytes_sent", "seconds_busy", "path_limited_bytes", "path_limited_seconds")


def _ratio_bps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds if seconds > 0 else 0.0


def stream_case(config_name: str = "report_kv", tokens: int = 1024, trials: int = 6, rate: str = "1gbit",
                delay_ms: float = 25.0) -> StreamResult:
    from ..testing.wan import WanLink

    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "md")
        md = link.b.spawn(main_decode, config_name, tokens, trials, info, f"{link.b.address}:{_MD_PORT}")
        p = link.a.call(prefill, config_name, tokens, trials, info, timeout=1800)
        applied = md.result(120)
        cfg = MODELS[config_name]
        kv_bytes = tokens * 2 * cfg.num_layers * cfg.kv_size * 8  # float64 K and V
        ms = {mode: [(applied[t] - p["prefill_end"][t]) * 1e3 for t in range(trials) if p["mode"][t] == mode]
              for mode in MODES}
        return StreamResult(config_name, tokens, kv_bytes, link.rate_bps, 2 * delay_ms,
                            [p["prefill_s"][t] * 1e3 for t in range(trials)], ms["streamed"], ms["after_prefill"],
                            p["link_readings"])


def format_table(r: StreamResult) -> str:
    d = r.as_dict()
    return "\n".join([
        f"{r.model}: {r.tokens}-token document, {r.kv_bytes / 2**20:.1f} MiB of KV, "
        f"{r.rate_bps / 1e9:g} Gbit/s, {r.rtt_ms:g} ms RTT; prefill {d['prefill_median_ms']:.0f} ms (median)",
        "KV applied at MD, after the end of prefill (median over trials):",
        f"  streamed per layer : {d['streamed_median_ms']:8.1f} ms",
        f"  after prefill      : {d['after_prefill_median_ms']:8.1f} ms",
        f"  line-rate floor    : {r.line_rate_ms:8.1f} ms (the KV at the link's rate + one-way delay)",
        "The link's rate as P's engine reads it over those trials (the router's input), Mbit/s:",
        *(f"  {mode.replace('_', ' '):<18}: {r.link_readings[mode]['path_limited_bps'] / 1e6:8.1f} path-limited, "
          f"{r.link_readings[mode]['busy_bps'] / 1e6:8.1f} bytes over busy time, line {r.rate_bps / 1e6:g}"
          for mode in MODES),
    ])
