"""The 'Smaller GPUs' section and its plot: the longest context a step finished with its GPU
memory capped, beside the plan.
"""
from __future__ import annotations

import os
from collections import defaultdict

from report_common import (
    BASELINES, Commands, DEFAULT_IMPLS, OFFLOAD, STEP_IMPLS, commit, day, newest, num, own_peaks, peak, section,
    shipped, step_command, step_settings, table)
from report_plan import PLAN_HOST_GIB, auto_longest, plan_checked, planned_peak


def select_gpu_sizes(rows: list[dict]) -> list[dict]:
    """Steps whose process capped its GPU memory (a smaller GPU's memory on the H200): for each
    cap, implementation, kind of gradients and attention, the longest context that finished."""
    capped = [r for r in own_peaks(rows) if shipped(r, STEP_IMPLS.__contains__) and r.get("ok")
              and r.get("gpu_cap_gib") and not r.get("packed_docs")]
    key = lambda r: (r["gpu_cap_gib"], r["impl"], r.get("lora_rank", 0), r.get("model", "qwen2.5-7b"))  # noqa: E731
    groups = defaultdict(list)
    for r in capped:
        groups[key(r)].append(r)
    picked = [newest([r for r in g if r["seq_len"] == max(x["seq_len"] for x in g)]) for g in groups.values()]
    return sorted(picked, key=key)


def gpu_label(r: dict) -> str:
    name = BASELINES.get(r["impl"], r["impl"])
    return f"{name}, {'LoRA r=' + str(r['lora_rank']) if r.get('lora_rank') else 'full'}"


def gpu_sizes_section(rows: list[dict], out_dir: str) -> str:
    cmds, out = Commands(), []
    picked = select_gpu_sizes(rows)
    longest = [auto_longest(r) if r["impl"] in DEFAULT_IMPLS else None for r in picked]  # the plan's, per row
    for r, reach in zip(picked, longest):
        planned = planned_peak(r) / 2**30 if r["impl"] in OFFLOAD else None
        out.append([f"{r['gpu_cap_gib']:g}", r.get("model", "qwen2.5-7b"), gpu_label(r), f"{r['seq_len']:,}",
                    f"{r['step_s']:.1f}", num(r["tok_s"]), peak(r), num(planned, ".2f"),
                    "—" if planned is None else f"{r['peak_gib'] / planned:.2f}", num(r.get("host_peak_gib"), ".1f"),
                    "—" if reach is None else f"{reach:,}",
                    step_settings(r) if r["impl"] in OFFLOAD else "gradient checkpointing", commit(r), day(r),
                    cmds.ref(step_command(r))])
    if not out:
        return ("_No rows yet: `python bench/bench_step.py --impls oomb-default,oomb-sparse-default,liger "
                "--lora-rank 16 --gpu-cap-gib 24 --lengths 128K,256K,512K,1M` (and 48, 80) measures them._")
    plot_gpu_sizes(picked, longest, os.path.join(out_dir, "longest_context_vs_gpu.png"))
    return section("capped step", out, cmds,
        "The longest context a step finished at with the process's GPU memory capped "
        "(`torch.cuda.set_per_process_memory_fraction`, `bench_step.py --gpu-cap-gib`) on an H200: a smaller "
        "GPU's memory, not its speed (its tokens/s are the H200's). oomb-default is what `oomb train` chooses "
        "for that memory with no tuning flags; transformers + Liger runs with gradient checkpointing. A "
        "transformers + Liger row is its limit (the next length ran out of memory); an oomb row is the longest "
        "length its run asked for, and the plot's dotted lines are the longest the plan fits (the table's "
        "plan's longest column).",
        "![Longest context against GPU memory](longest_context_vs_gpu.png)",
        table(["GPU GiB", "model", "implementation", "longest tokens", "s / step", "tok/s", "peak GPU GiB",
               "plan GiB", "peak ÷ plan", "host GiB", f"plan's longest (host {PLAN_HOST_GIB} GiB)", "settings",
               "commit", "date", "command"], out),
        "Rows: for each cap, implementation and kind of gradients, the longest context that finished; the newest "
        "row there (each run stops an implementation at its first length that does not fit). Plan: what "
        "`oomb plan` gives that step's GPU memory today, placed as its engine placed it (report_plan.planned_peak: "
        "weights, gradients, one chunk's working set, the pages of the layers on the GPU, staging, kept outputs "
        "on the GPU); a planned step keeps 5 % of the GPU (2 GiB at least) free beside it. Plan's longest: the "
        "longest context `oomb train` would choose settings for at that cap, by the plan, with AdamW's state "
        f"counted and {PLAN_HOST_GIB} GiB of host memory for pages (what a 128 GiB machine leaves); its most "
        "frugal setting (chunk 1024, bf16 dK/dV, layers recomputed) reaches it, so host memory, not the GPU, "
        "bounds it.",
        plan_summary(rows))


def plan_summary(rows: list[dict]) -> str:
    """One sentence: how the plan compares with every oomb step that records its placement."""
    checked = plan_checked(rows)
    if not checked:
        return ""
    ratios = [x for _, x in checked]
    return (f"Over all {len(checked)} oomb steps that record where their engine put pages and kept outputs "
            f"(whole and capped GPUs, {min(day(r) for r, _ in checked)} to {max(day(r) for r, _ in checked)}), the "
            f"measured peak is {min(ratios):.2f}x to {max(ratios):.2f}x of today's plan for it "
            "(tests/test_report.py holds it within 10 %).")


def plot_gpu_sizes(rows: list[dict], longest: list[int | None], path: str) -> None:
    """Each implementation's measured context against the cap; beside each oomb-default line, the
    longest context the plan fits (`longest`, a row's auto_longest or None)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    lines = defaultdict(list)
    for r in rows:
        lines[gpu_label(r)].append((r["gpu_cap_gib"], r["seq_len"]))
    planned = defaultdict(list)  # oomb train's choice: the longest context the plan fits at each cap
    for r, reach in zip(rows, longest):
        if reach is not None:
            planned[gpu_label(r)].append((r["gpu_cap_gib"], reach))
    for i, (label, points) in enumerate(sorted(lines.items())):
        points.sort()
        style = "--" if label.startswith("transformers") else "-"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label, color=f"C{i}")
        if label in planned:
            points = sorted(planned[label])
            ax.plot([p[0] for p in points], [p[1] for p in points], ":", marker="x", color=f"C{i}",
                    label=f"{label}: the plan's longest (host {PLAN_HOST_GIB} GiB)")
    ax.set_xlabel("GPU memory (GiB, the process's cap on an H200)")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("context (tokens)")
    ax.set_title("Context of a training step against GPU memory: measured (o), planned (x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
