"""The ``pddcore bench`` cases as the command runs them: each runner calls its case module
(``--quick`` or full sizes, the transfer backend) and returns the case's data for
``results.json``, its text and its rows of the summary table, each a measurement beside its
in-run baseline. A case that cannot run here raises :class:`Skipped`; the WAN cases run in
a freshly spawned interpreter each.

Example::

    from pddcore.benchmarks.runners import RUNNERS

    out = RUNNERS["radix"](True, "tcp")       # quick sizes
    print(out.text, [(r.what, r.ratio) for r in out.rows])
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from . import (codec_cases, codec_wan, crc_cases, demo_cases, extend_cases, handoff_cases, loss_cases, pack_cases,
               peer_cases, radix_cases, rdma_cases, serve_cases, stream_cases, tls_cases, transfer_cases, transfer_wan_cases)
from .results import Result

CASES = ("pack", "transfer", "tls", "wan", "loss", "peers", "wan10g", "stream", "handoff", "extend", "radix", "codec",
         "demo", "serve")


@dataclass
class Row(Result):
    """One line of the results table: a measurement, its baseline and their ratio."""

    case: str
    what: str
    value: float
    baseline_name: str
    baseline: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")


@dataclass
class CaseOutput:
    data: dict
    text: str
    rows: list[Row]


class Skipped(Exception):
    """A case that cannot run on this machine (the message says why)."""


def case_pack(quick: bool, backend: str) -> CaseOutput:
    results = pack_cases.run_points(quick)
    rows = []
    for r in results:
        tag = f"{r.label}, {r.threads} thr"
        rows.append(Row("pack", f"pack {tag}", r.pack_gbps, "copy_", r.copy_gbps, "GB/s"))
        rows.append(Row("pack", f"unpack {tag}", r.unpack_gbps, "copy_", r.copy_gbps, "GB/s"))
        rows.append(Row("pack", f"pack pool order {tag}", r.pool_pack_gbps, "copy_", r.copy_gbps, "GB/s"))
        rows.append(Row("pack", f"unpack pool order {tag}", r.pool_unpack_gbps, "copy_", r.copy_gbps, "GB/s"))
    return CaseOutput({"points": [r.as_dict() for r in results]}, pack_cases.format_table(results), rows)


def case_transfer(quick: bool, backend: str) -> CaseOutput:
    if quick:
        results = transfer_cases.loopback_matrix(32 << 20, 2, (64 << 10, 1 << 20), (1, 4), backend=backend)
    else:
        results = transfer_cases.loopback_matrix(backend=backend)
    emulated = backend == "rdma" and os.environ.get("PDDCORE_VERBS") == "emulator"
    label = "rdma-emulator" if emulated else backend  # the verbs emulator's numbers are not a NIC's
    rows = [Row("transfer", f"{label} {r.chunk_bytes >> 10} KiB chunks x {r.streams} streams", r.engine_gbps,
                "raw socket", r.raw_gbps, "GB/s") for r in results]
    data = {"backend": label, "points": [r.as_dict() for r in results]}
    text = transfer_cases.format_loopback(results)
    crc = crc_cases.crc32c_rates((64 << 20) if quick else (256 << 20))
    data["crc32c"] = [r.as_dict() for r in crc]
    rows += [Row("transfer", f"crc32c {r.implementation}, {r.where}", r.crc_gbps, "memcpy", r.memcpy_gbps, "GB/s")
             for r in crc if r.implementation != "table"]
    text += "\n\n" + crc_cases.format_table(crc)
    if backend == "tcp":
        auto = transfer_cases.congestion_loopback((64 << 20) if quick else (256 << 20), 5)
        data["congestion_control"] = [c.as_dict() for c in auto]
        rows += _auto_rows("transfer", auto)
        text += "\n\n" + loss_cases.format_comparisons(auto)
    if backend == "rdma" and rdma_cases.nic_line_rate() is not None:
        line = rdma_cases.rdma_vs_line_rate(nbytes=(256 << 20) if quick else (1 << 30))
        data["line_rate"] = line.as_dict()
        rows.append(Row("transfer", f"rdma {line.device} goodput", line.goodput_gbit, "NIC line rate",
                        line.line_gbit, "Gbit/s"))
        text += f"\nRDMA {line.device}: {line.goodput_gbit:.1f} Gbit/s = {line.ratio:.2f}x line rate"
    return CaseOutput(data, text, rows)


def _need_wan() -> None:
    from ..testing.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise Skipped(reason)


def _in_fresh_process(fn: Callable, *args, **kwargs):
    """Runs ``fn`` in a newly spawned interpreter and returns its (picklable) result.

    The WAN cases fork helpers into namespaces, which needs a process that can fork
    safely; by then this one has run OpenMP regions and transfer engines. A crash
    there (reported with a faulthandler traceback) fails only that case."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_with_faulthandler, fn, args, kwargs).result()


def _with_faulthandler(fn: Callable, args: tuple, kwargs: dict):
    import faulthandler

    faulthandler.enable()
    return fn(*args, **kwargs)


def case_wan(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    if backend != "tcp":
        raise Skipped("the WAN path is tcp")
    from . import wan_cases

    if quick:
        r = _in_fresh_process(transfer_wan_cases.wan_case, rate="200mbit", delay_ms=10, nbytes=128 << 20, probes=10,
                              settle_s=2.0)
    else:
        r = _in_fresh_process(transfer_wan_cases.wan_case, rate="1gbit", delay_ms=25)
    rate = "200mbit" if quick else "1gbit"
    tcp = _in_fresh_process(wan_cases.bulk_tcp, rate, r.rtt_ms / 2, seconds=3.0 if quick else 6.0)
    line = _in_fresh_process(wan_cases.delay_line_capacity, 1500, seconds=2.0 if quick else 3.0)
    # The short-transfer row at full size either way: 256 MiB at 1 Gbit/s, 50 ms.
    fk = _in_fresh_process(transfer_wan_cases.fresh_and_kept, "1gbit", 25, 256 << 20, rounds=3)
    rows = [Row("wan", f"engine goodput {r.rate_bps / 1e9:.1f} Gbit/s RTT {r.rtt_ms:.0f} ms", r.goodput_gbps,
                "line rate", r.rate_bps / 1e9, "Gbit/s"),
            Row("wan", "same writes again, kept connections", r.kept_goodput_gbps, "line rate", r.rate_bps / 1e9,
                "Gbit/s"),
            Row("wan", f"{fk.nbytes >> 20} MiB, {fk.rtt_ms:.0f} ms, new engine, first write", fk.fresh_gbps,
                "line rate", fk.rate_bps / 1e9, "Gbit/s"),
            Row("wan", f"{fk.nbytes >> 20} MiB, {fk.rtt_ms:.0f} ms, kept connections", fk.kept_gbps, "line rate",
                fk.rate_bps / 1e9, "Gbit/s"),
            Row("wan", "plain TCP stream, steady state", tcp.steady_gbps, "line rate", r.rate_bps / 1e9, "Gbit/s"),
            Row("wan", "priority msg one-way, under bulk", r.loaded_latency_ms, "idle link", r.idle_latency_ms, "ms"),
            Row("wan", "priority msg one-way, under paced bulk", r.paced_latency_ms, "idle link", r.idle_latency_ms,
                "ms"),
            Row("wan", f"engine goodput, self-paced to a {r.queue_delay_target_ms:g} ms queue", r.auto_goodput_gbps,
                "line rate", r.rate_bps / 1e9, "Gbit/s"),
            Row("wan", "priority msg one-way, under self-paced bulk", r.auto_latency_ms, "idle link",
                r.idle_latency_ms, "ms"),
            Row("wan", "delay line packets/s per core, MTU 1500", line.pps_per_core, "needed for 1 Gbit/s",
                line.pps_needed_1g, "pkt/s")]
    return CaseOutput({"engine": r.as_dict(), "fresh_and_kept": fk.as_dict(), "plain_tcp": tcp.as_dict(),
                       "delay_line": line.as_dict()},
                      transfer_wan_cases.format_wan(r) + "\n" + transfer_wan_cases.format_fresh_kept(fk)
                      + f"\nplain TCP stream: {tcp.steady_gbps:.3f} Gbit/s steady "
                      f"= {tcp.ratio:.3f}x line rate\ndelay line, MTU 1500: {line.pps_per_core / 1e3:.0f} kpps "
                      f"per core = {line.ratio_1g:.2f}x the rate 1 Gbit/s needs", rows)


def _auto_rows(case: str, comparisons: list) -> list[Row]:
    return [Row(case, f"cc auto, {c.path}", c.auto_gbps, f"{c.better} by hand", c.better_gbps, "Gbit/s")
            for c in comparisons]


def case_loss(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    if backend != "tcp":
        raise Skipped("the WAN path is tcp")
    # Quick: the rows "auto" is judged on (clean and 0.1 % loss). Medians of 5 rounds: single
    # transfers on a shared machine scatter by 20 % and more.
    losses = (0.0, 0.001) if quick else (0.0, *loss_cases.LOSSES)
    pieces = (64 << 10,) if quick else (64 << 10, 1 << 20)
    # Lossy rows move fewer bytes where cubic crawls; clean ones enough to leave slow start behind.
    results = [r for loss in losses
               for r in _in_fresh_process(loss_cases.loss_case, loss, loss_cases.CONGESTION_CONTROLS,
                                          piece_sizes=pieces, offload=False, mtu=9000, rounds=5,
                                          nbytes=(32 << 20) if loss >= 0.01 else (256 << 20))]
    rows = [Row("loss", f"{100 * r.loss:g} % loss, {r.congestion_control}, {r.piece_bytes >> 10} KiB pieces, "
                f"{r.rtt_ms:g} ms RTT", r.goodput_gbps, "line rate", r.rate_bps / 1e9, "Gbit/s") for r in results]
    auto = loss_cases.compare_auto(results)
    return CaseOutput({"points": [r.as_dict() for r in results], "congestion_control": [c.as_dict() for c in auto]},
                      loss_cases.format_table(results) + "\n\n" + loss_cases.format_comparisons(auto),
                      rows + _auto_rows("loss", auto))


def case_peers(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    if backend != "tcp":
        raise Skipped("the WAN path is tcp")
    report = _in_fresh_process(peer_cases.peers_case, peer_cases.QUICK_POINTS if quick else peer_cases.FULL_POINTS,
                               nbytes=(32 << 20) if quick else (128 << 20))
    rows = [Row("peers", what, ours, peer, theirs, "Gbit/s")
            for what, ours, peer, theirs in peer_cases.summary(report)]
    return CaseOutput(report.as_dict(), peer_cases.format_table(report), rows)


def case_wan10g(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    if backend != "tcp":
        raise Skipped("the WAN path is tcp")
    from . import wan_cases

    results, ceilings = [], []
    for delay in (10, 25):
        # No loss: TSO batches cross the delay line whole, which at this rate costs its core
        # less than jumbo frames one by one (measured both ways with plain TCP).
        results += _in_fresh_process(loss_cases.loss_case, 0.0, loss_cases.CONGESTION_CONTROLS, rate="10gbit",
                                     delay_ms=delay, streams=8, chunk_bytes=4 << 20, rounds=5,
                                     nbytes=(1 << 30) if quick else (4 << 30))
        ceilings.append(_in_fresh_process(wan_cases.bulk_tcp, "10gbit", delay, seconds=3.0 if quick else 6.0,
                                          streams=8))
    rows = []
    for r in results:
        ceiling = next(c for c in ceilings if c.rtt_ms == r.rtt_ms)
        what = f"{r.congestion_control}, {r.streams} streams, {r.rtt_ms:g} ms RTT"
        rows += [Row("wan10g", f"engine goodput, {what}", r.goodput_gbps, "line rate", r.rate_bps / 1e9, "Gbit/s"),
                 Row("wan10g", f"engine goodput, {what}", r.goodput_gbps, f"plain TCP, {ceiling.streams} streams",
                     ceiling.steady_gbps, "Gbit/s")]
    auto = loss_cases.compare_auto(results)
    text = loss_cases.format_table(results) + "".join(
        f"\nplain TCP over {c.streams} connections through the same link, {c.rtt_ms:g} ms RTT: {c.steady_gbps:.3f} "
        f"Gbit/s steady = {c.ratio:.3f}x line rate" for c in ceilings) + "\n\n" + loss_cases.format_comparisons(auto)
    return CaseOutput({"points": [r.as_dict() for r in results], "plain_tcp": [c.as_dict() for c in ceilings],
                       "congestion_control": [c.as_dict() for c in auto]}, text, rows + _auto_rows("wan10g", auto))


def case_stream(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    if backend != "tcp":
        raise Skipped("the WAN path is tcp")
    r = _in_fresh_process(stream_cases.stream_case, tokens=256 if quick else 1024, trials=4 if quick else 10,
                          rate="200mbit" if quick else "1gbit")
    d = r.as_dict()
    rows = [Row("stream", f"KV applied at MD after prefill end, streamed per layer ({r.tokens} tokens)",
                d["streamed_median_ms"], "posted after prefill", d["after_prefill_median_ms"], "ms")]
    rows += [Row("stream", f"router's link reading, path-limited, {mode.replace('_', ' ')}",
                 r.link_readings[mode]["path_limited_bps"] / 1e6, "bytes over busy time",
                 r.link_readings[mode]["busy_bps"] / 1e6, "Mbit/s") for mode in stream_cases.MODES]
    return CaseOutput(d, stream_cases.format_table(r), rows)


def case_handoff(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    # Full: each model under background bulk (the report's setting), then on an idle link
    # as the control that separates the load's effect from the paths' own cost.
    runs = [("embedded", True, 50)] if quick else [
        (m, bulk, 100 if bulk else 50) for bulk in (True, False) for m in handoff_cases.MODELS]
    results = [_in_fresh_process(handoff_cases.handoff_case, m, trials=n, background_bulk=bulk)
               for m, bulk, n in runs]
    rows = []
    for r in results:
        a, b = r.kv.summary, r.ids.summary
        load = "bulk" if r.background_bulk else "idle"
        for key, unit in (("payload_bytes", "B"), ("mean_ms", "ms"), ("p99_ms", "ms"), ("max_ms", "ms"),
                          ("std_ms", "ms")):
            rows.append(Row("handoff", f"{r.model}, {load}: token ids {key.replace('_ms', '').replace('_bytes', '')}",
                            b[key], "KV", a[key], unit))
    return CaseOutput({"models": [r.as_dict() for r in results], "report": handoff_cases.REPORT},
                      "\n".join(handoff_cases.format_handoff(r) for r in results), rows)


def case_extend(quick: bool, backend: str) -> CaseOutput:
    tokens = (1, 8, 64, 512) if quick else extend_cases.TOKENS
    results = extend_cases.extend_sweep(tokens, repeats=1 if quick else 3)
    rows = [Row("extend", f"extend {r.new_tokens} tokens", r.extend_s * 1000, f"{r.new_tokens} decode steps",
                r.decode_steps_s * 1000, "ms") for r in results]
    return CaseOutput({"points": [r.as_dict() for r in results]}, extend_cases.format_extend(results), rows)


def case_radix(quick: bool, backend: str) -> CaseOutput:
    results = [radix_cases.run_case(200 if quick else 2000, page) for page in ((16,) if quick else (16, 64))]
    rows = []
    for r in results:
        rows.append(Row("radix", f"match, page {r.page_size}", r.radix_match_ops_s, "hash chain",
                        r.chain_match_ops_s, "ops/s"))
        rows.append(Row("radix", f"insert, page {r.page_size}", r.radix_insert_ops_s, "hash chain",
                        r.chain_insert_ops_s, "ops/s"))
    return CaseOutput({"points": [r.as_dict() for r in results]}, "\n".join(r.table() for r in results), rows)


def case_serve(quick: bool, backend: str) -> CaseOutput:
    _need_wan()
    r = _in_fresh_process(serve_cases.serve_case, requests=6 if quick else 12)
    pd, pdd = r.modes["pd"], r.modes["pdd"]
    rows = [Row("serve", f"PDD TTFT p{q} through the gateway", 1e3 * pdd["ttft_s"][q], "cross-DC PD",
                1e3 * pd["ttft_s"][q], "ms") for q in (50, 90, 99)]
    rows += [Row("serve", "handoff gap, median", 1e3 * pdd["handoff_gap_s"][50], "median TPOT (PDD)",
                 1e3 * pdd["tpot_s"][50], "ms"),
             Row("serve", "TPOT through the gateway", r.gateway_tpot_ms, "the engine streamed directly",
                 r.direct_tpot_ms, "ms")]
    return CaseOutput(r.as_dict(), serve_cases.format_table(r), rows)


def case_demo(quick: bool, backend: str) -> CaseOutput:
    r = demo_cases.demo_case(quick)
    rows = [Row("demo", f"PDD TTFT {p}", 1e3 * r.ttft_s["pdd"][p], "cross-DC PD", 1e3 * r.ttft_s["pd"][p], "ms")
            for p in demo_cases.PERCENTILES]
    return CaseOutput(r.as_dict(), demo_cases.format_result(r), rows)


def case_tls(quick: bool, backend: str) -> CaseOutput:
    if backend != "tcp":
        raise Skipped("TLS is on the tcp backend's connections")
    results = tls_cases.loopback((64 << 20) if quick else (256 << 20), rounds=2 if quick else 3,
                                 connects=10 if quick else 20)
    rows = []
    for r in results:
        where = f"loopback {r.streams} stream{'s' * (r.streams > 1)}"
        rows += [Row("tls", f"{where}, TLS (token)", r.tls_gbps, "plain", r.plain_gbps, "GB/s"),
                 Row("tls", f"{where}, TLS (certificates)", r.cert_gbps, "plain", r.plain_gbps, "GB/s"),
                 Row("tls", f"{where}, TLS (certificates)", r.cert_gbps, "TLS (token)", r.tls_gbps, "GB/s"),
                 Row("tls", f"{where}, connect(), certificates", r.connect_ms["cert"], "TLS (token)",
                     r.connect_ms["tls"], "ms"),
                 Row("tls", f"{where}, connect(), certificates", r.connect_ms["cert"], "plain",
                     r.connect_ms["plain"], "ms")]
    cipher = tls_cases.cipher_gbps((256 << 20) if quick else (1 << 30))
    rows.append(Row("tls", "AES-128-GCM seal, one core", cipher, "10 Gbit/s line", 1.25, "GB/s"))
    text = tls_cases.format_table(results)
    from ..testing.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        wan = _in_fresh_process(tls_cases.wan, rate="200mbit" if quick else "1gbit", delay_ms=10 if quick else 25,
                                nbytes=(64 << 20) if quick else (512 << 20))
        results.append(wan)
        rows += [Row("tls", f"{wan.where} goodput, TLS (token)", wan.tls_gbps, "line rate", wan.line_gbps, "Gbit/s"),
                 Row("tls", f"{wan.where} goodput, TLS (token)", wan.tls_gbps, "plain", wan.plain_gbps, "Gbit/s"),
                 Row("tls", f"{wan.where} goodput, TLS (certificates)", wan.cert_gbps, "plain", wan.plain_gbps,
                     "Gbit/s"),
                 Row("tls", f"{wan.where} goodput, TLS (certificates)", wan.cert_gbps, "TLS (token)", wan.tls_gbps,
                     "Gbit/s")]
        text = tls_cases.format_table(results)
    else:
        text += f"\n(WAN rows skipped: {reason})"
    text += f"\nAES-128-GCM, one core, 16 KiB records: {cipher:.2f} GB/s = {cipher / 1.25:.1f}x a 10 Gbit/s link"
    return CaseOutput({"points": [r.as_dict() for r in results], "aes_gcm_gbps": cipher}, text, rows)


def case_codec(quick: bool, backend: str) -> CaseOutput:
    report = codec_cases.run(quick)
    rows = []
    zstd_one_thread = {p.kv: p for p in report.points if p.codec == "zstd"}
    for p in report.points:
        if p.codec == codec_cases.INTERLEAVED:
            continue
        tag = f"{p.codec}, {p.kv}"
        if codec_cases.is_threaded(p.codec):  # the same frames as zstd: its speed is the point
            one = zstd_one_thread[p.kv]
            rows += [Row("codec", f"{tag}: encode", p.encode_gbps, "zstd, one thread", one.encode_gbps, "GB/s"),
                     Row("codec", f"{tag}: decode", p.decode_gbps, "zstd, one thread", one.decode_gbps, "GB/s")]
            continue
        rows += [Row("codec", f"{tag}: wire bytes", p.frame_bytes, "raw KV", p.raw_bytes, "B"),
                 Row("codec", f"{tag}: encode", p.encode_gbps, "memcpy", p.memcpy_gbps, "GB/s"),
                 Row("codec", f"{tag}: decode", p.decode_gbps, "memcpy", p.memcpy_gbps, "GB/s")]
    rows += [Row("codec", f"fp8, {e.kv}: max error / page amax", e.max_rel_amax, "E4M3 bound", e.bound_rel_amax, "")
             for e in report.fp8_error]
    rows += [Row("codec", f"{g.arm} KV: identical greedy requests", g.identical, "requests", g.requests, "")
             for g in report.greedy]
    data, text = report.as_dict(), codec_cases.format_report(report)
    from ..testing.wan import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        rates = codec_wan.WAN_RATES[:1] if quick else codec_wan.WAN_RATES
        wans = [_in_fresh_process(codec_wan.wan_case, rate, trials=3 if quick else 10) for rate in rates]
        data["wan"] = [w.as_dict() for w in wans]
        text += "".join("\n\n" + codec_wan.format_wan(w) for w in wans)
        rows += codec_wan_rows(wans)
    else:
        text += f"\n(WAN rows skipped: {reason})"
    return CaseOutput(data, text, rows)


def codec_wan_rows(wans: list[codec_wan.WanResult]) -> list[Row]:
    """Per link, payload and codec: the median end to end against ``none``'s (``none``'s
    against the line-rate floor)."""
    rows = []
    for w in wans:
        for p in w.points:
            what = f"{p.codec}, {p.tokens}-token {p.payload}, {w.rate_bps / 1e6:g}Mbit/s {w.rtt_ms:g}ms"
            baseline = ("line-rate floor", w.line_rate_ms(p)) if p.codec == "none" else \
                ("none", w.baseline(p).median_ms)
            rows.append(Row("codec", what, p.median_ms, *baseline, "ms"))
    return rows


RUNNERS: dict[str, Callable[[bool, str], CaseOutput]] = {
    "pack": case_pack, "transfer": case_transfer, "tls": case_tls, "wan": case_wan, "loss": case_loss,
    "peers": case_peers, "wan10g": case_wan10g, "stream": case_stream, "handoff": case_handoff,
    "extend": case_extend, "radix": case_radix, "codec": case_codec, "demo": case_demo, "serve": case_serve,
}
