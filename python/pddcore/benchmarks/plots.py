"""The PNG plots `pddcore bench` writes beside ``results.json``: one per case that has a
curve or a distribution (pack, transfer, handoff, extend), drawn from the case's entry in
``results.json["cases"]``.

Example::

    write_plots(json.load(open("pddcore-bench/results.json"))["cases"], "pddcore-bench")
"""

from __future__ import annotations

import os


def write_plots(cases: dict, out_dir: str) -> list[str]:
    """One PNG per case that has a curve or a distribution; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "points" in cases.get("pack", {}):
        pts = cases["pack"]["points"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for threads in sorted({p["threads"] for p in pts}):
            sel = [p for p in pts if p["threads"] == threads and not p["vllm_rows"]]
            x = [p["page_bytes"] / 1024 for p in sel]
            ax.plot(x, [p["pack_gbps"] for p in sel], "o-", label=f"pack, {threads} thr")
            ax.plot(x, [p["unpack_gbps"] for p in sel], "s--", label=f"unpack, {threads} thr")
            ax.plot(x, [p["copy_gbps"] for p in sel], "k:", marker="x", label=f"copy_ baseline, {threads} thr")
        ax.set(xscale="log", xlabel="page size (KiB)", ylabel="GB/s", title="pack / unpack vs contiguous copy")
        ax.legend(fontsize=7)
        save(fig, "pack.png")

    if "points" in cases.get("transfer", {}):
        pts = cases["transfer"]["points"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for streams in sorted({p["streams"] for p in pts}):
            sel = sorted((p for p in pts if p["streams"] == streams), key=lambda p: p["chunk_bytes"])
            x = [p["chunk_bytes"] / 1024 for p in sel]
            line, = ax.plot(x, [p["engine_gbps"] for p in sel], "o-", label=f"engine, {streams} streams")
            ax.plot(x, [p["raw_gbps"] for p in sel], "x:", color=line.get_color(), label=f"raw socket, {streams}")
        ax.set(xscale="log", xlabel="chunk size (KiB)", ylabel="GB/s",
               title=f"TransferEngine ({cases['transfer']['backend']}) vs raw sockets, loopback")
        ax.legend(fontsize=7)
        save(fig, "transfer.png")

    if "models" in cases.get("handoff", {}):
        models = cases["handoff"]["models"]
        report = cases["handoff"]["report"]
        cols = min(2, len(models))
        rows_ = -(-len(models) // cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(6 * cols, 4 * rows_), squeeze=False)
        for ax, m in zip(axes.flat, models):
            for key, label, color in (("kv", "(a) KV: pack + write + unpack", "tab:red"),
                                      ("ids", "(b) token ids + extend", "tab:blue")):
                s = sorted(m[key]["samples_ms"])
                ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", color=color,
                        label=f"{label} ({m[key]['payload_bytes'] / 1024:.1f} KB)")
                ax.axvline(report[key]["mean_ms"], color=color, ls=":", lw=1, label=f"report mean {key}")
            load = "background bulk" if m["background_bulk"] else "idle link"
            ax.set(xlabel="handoff latency (ms)", ylabel="fraction of trials",
                   title=f"'{m['model']}' model, {load}, {m['kv']['trials']} trials each", xscale="log")
            ax.legend(fontsize=7, loc="lower right")
        for ax in axes.flat[len(models):]:
            ax.axis("off")
        save(fig, "handoff.png")

    if "points" in cases.get("extend", {}):
        pts = cases["extend"]["points"]
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [p["new_tokens"] for p in pts]
        ax.plot(x, [1000 * p["extend_s"] for p in pts], "o-", label="one extend pass")
        ax.plot(x, [1000 * p["decode_steps_s"] for p in pts], "x:", label="N decode steps (baseline)")
        ax.set(xscale="log", yscale="log", xlabel="handed-off tokens N", ylabel="ms",
               title="recompute on the embedded model (CPU, float64)")
        ax.legend()
        save(fig, "extend.png")
    return written
