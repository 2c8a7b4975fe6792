"""The 'Top-k sparse steps' section and the plot of where a 1M step's time goes."""
from __future__ import annotations

from report_common import (
    Commands, OFFLOAD, commit, day, kept, newest_each, num, peak, section, step_command, step_rows, step_settings,
    table, tokens)


def topk_label(r: dict) -> str:
    parts = [f"offload '{OFFLOAD[r['impl']]}'"]
    if r.get("checkpoint_layers"):
        parts.append("checkpoint_layers")
    if kept(r):
        parts.append("outputs kept")
    if r.get("float8", "none") != "none":
        parts.append(f"float8 {r['float8']}")
    if r.get("lora_rank"):
        parts.append(f"LoRA r={r['lora_rank']}")
    return ", ".join(parts)


def select_topk(rows: list[dict]) -> list[dict]:
    """Top-k steps of the Qwen2.5-7B shape at the default chunk 4096: the newest row of each
    configuration (offload mode, checkpoint_layers, kept outputs, float8, LoRA) at each context."""
    order = ["oomb-sparse-auto", "oomb-sparse-all", "oomb-sparse"]
    rows = [r for r in step_rows(rows) if r["impl"] in order and r.get("model", "qwen2.5-7b") == "qwen2.5-7b"
            and r.get("layers") == 28 and r.get("chunk_size") == 4096 and r.get("page_budget_gib") is None
            and r.get("param_grad_dtype") != "fp32"]
    picked = newest_each(rows, lambda r: (topk_label(r), r["seq_len"]))
    return sorted(picked, key=lambda r: (order.index(r["impl"]), bool(r.get("checkpoint_layers")),
                                         r.get("lora_rank") or 0, r.get("float8", "none"), kept(r), r["seq_len"]))


def topk_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r in select_topk(rows):
        stages = ("—" if r.get("stage1_s") is None else f"{r['stage1_s']:.1f} / {r['stage2_s']:.1f}")
        out.append([topk_label(r), tokens(r["seq_len"]), f"{r['step_s']:.2f}", num(r["tok_s"]), stages, peak(r),
                    num(r.get("host_peak_gib"), ".1f"), step_settings(r), commit(r), day(r),
                    cmds.ref(step_command(r))])
    return section("top-k step", out, cmds,
        "One step with `TopKPages(budget=64)`: each block of 128 queries attends 64 pages of 128 keys (sinks "
        "included), chosen among the chunk's 256 candidate pages, so a chunk's attention does not grow with the "
        "context. Qwen2.5-7B shape, full-parameter gradients unless a row says LoRA, chunk 4096. Stage 1 runs the "
        "forward of chunks 0 .. n-2 and writes their pages; stage 2 runs each chunk again, last to first, "
        "forward and backward. Host GiB is the process's peak resident memory (pinned pages and kept outputs).",
        "![Where a 1M-token top-k step's time goes](step_1m_breakdown.png)",
        table(["configuration", "context", "s / step", "tok/s", "stage 1 / stage 2 s", "peak GPU GiB", "host GiB",
               "settings", "commit", "date", "command"], out),
        "Rows: for each configuration and context, the newest row. The plot splits the 1M rows that record "
        "their stages: seconds in each stage (CUDA events at each chunk pass, no synchronisation) and the mean "
        "milliseconds of a chunk pass by quarter of the sequence; the rows do not split the time by kernel.")


def plot_1m_breakdown(rows: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["seq_len"] == 2**20 and r.get("stage1_s") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.8 * max(len(mine), 3) + 2.5),
                                      gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{topk_label(r)}\n{commit(r)}, {day(r)}" for r in mine]
    y = list(range(len(mine)))
    s1 = [r["stage1_s"] for r in mine]
    s2 = [r["stage2_s"] for r in mine]
    rest = [max(r["step_s"] - a - b, 0) for r, a, b in zip(mine, s1, s2)]
    left.barh(y, s1, color="C0", label="stage 1: forward, pages written")
    left.barh(y, s2, left=s1, color="C1", label="stage 2: forward again + backward")
    left.barh(y, rest, left=[a + b for a, b in zip(s1, s2)], color="0.7", label="outside the chunk passes")
    for i, r in enumerate(mine):
        left.text(r["step_s"], i, f" {r['step_s']:.1f} s", va="center", fontsize=8)
    left.set_yticks(y)
    left.set_yticklabels(labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("seconds of one 1,048,576-token step")
    left.set_xlim(0, max((r["step_s"] for r in mine), default=1) * 1.18)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    left.set_title("Where a 1M-token top-k step's time goes")
    for i, r in enumerate(mine):
        q1, q2 = r.get("stage1_chunk_ms") or [], r.get("stage2_chunk_ms") or []
        right.plot(range(1, len(q2) + 1), q2, "-o", color=f"C{i + 2}", label=topk_label(r))
        right.plot(range(1, len(q1) + 1), q1, "--s", color=f"C{i + 2}")
    right.plot([], [], "-", color="0.3", label="(solid: stage 2, dashed: stage 1)")
    right.set_xticks([1, 2, 3, 4])
    right.set_xticklabels(["1st", "2nd", "3rd", "4th"])
    right.set_xlabel("quarter of the sequence (chunk position)")
    right.set_ylabel("ms per chunk pass (mean)")
    right.set_ylim(bottom=0)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7, loc="center right")
    right.set_title("A chunk pass by its position")
    if not mine:
        left.text(0.5, 0.5, "no 1M row records its stages", ha="center", transform=left.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
