"""The 'GPU memory vs context' section and its two plots: peak memory and tokens/s against the
context, one line per offload mode.
"""
from __future__ import annotations

from collections import defaultdict

from report_common import (
    Commands, H200_GIB, base_options, commit, day, kept, newest, num, section, step_command, step_rows,
    step_settings, table, tokens)

MEMORY_MODES = [
    ("oomb dense, offload none", lambda r: r["impl"] == "oomb" and not kept(r)),
    ("oomb dense, offload none, attention outputs kept", lambda r: r["impl"] == "oomb" and kept(r)),
    ("oomb dense, offload all", lambda r: r["impl"] == "oomb-all" and not kept(r)),
    ("oomb dense, offload auto", lambda r: r["impl"] == "oomb-auto" and not kept(r)),
    ("oomb top-k, offload none", lambda r: r["impl"] == "oomb-sparse"),
    ("oomb top-k, offload auto", lambda r: r["impl"] == "oomb-sparse-auto" and not r.get("checkpoint_layers")),
    ("oomb top-k, offload all", lambda r: r["impl"] == "oomb-sparse-all" and not r.get("checkpoint_layers")
     and not kept(r)),
    ("oomb minimum memory (top-k, offload all, checkpoint_layers)",
     lambda r: r["impl"] == "oomb-sparse-all" and r.get("checkpoint_layers") and not kept(r)),
    ("transformers + Liger", lambda r: r["impl"] == "liger"),
    ("transformers", lambda r: r["impl"] == "hf"),
]


def select_memory(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """For each mode: the chunk size it was measured at most contexts (4096, the default, on a tie);
    at each context, the newest row at that chunk size whose peak is its own. (label, rows) per mode
    that has rows."""
    rows = [r for r in step_rows(rows) if base_options(r) and not r.get("lora_rank") and r["own_peak"]]
    picked = []
    for label, is_mode in MEMORY_MODES:
        mine = [r for r in rows if is_mode(r)]
        if not mine:
            continue
        contexts = defaultdict(set)
        for r in mine:
            contexts[r.get("chunk_size")].add(r["seq_len"])
        chunk = max(contexts, key=lambda c: (len(contexts[c]), c == 4096))
        at = defaultdict(list)
        for r in mine:
            if r.get("chunk_size") == chunk:
                at[r["seq_len"]].append(r)
        picked.append((label if chunk is None else f"{label}, chunk {chunk}", [newest(at[n]) for n in sorted(at)]))
    return picked


def memory_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for label, mine in select_memory(rows):
        for r in mine:
            out.append([label, tokens(r["seq_len"]), f"{r['peak_gib']:.1f}", f"{r['step_s']:.2f}", num(r["tok_s"]),
                        step_settings(r), commit(r), day(r), cmds.ref(step_command(r))])
    return section("step", out, cmds,
        "Peak GPU memory (`torch.cuda.max_memory_allocated`) and speed of one step of the Qwen2.5-7B shape, "
        "full-parameter gradients, by offload mode. 'none' keeps every page on the GPU; 'all' keeps them in "
        "pinned host memory and streams them through; 'auto' keeps layers' pages on the GPU while they fit and "
        "puts the other layers' pages on the host, so its peak follows the GPU's free memory. Top-k attends "
        "64 pages of 128 keys per block of queries (`TopKPages(budget=64)`).",
        "![Peak GPU memory against the context, one line per mode](memory_vs_context.png)",
        "![Tokens per second against the context, one line per mode](tokens_per_s_vs_context.png)",
        table(["mode", "context", "peak GiB", "s / step", "tok/s", "settings", "commit", "date", "command"], out),
        "Rows (and plotted points): for each mode, the chunk size it was measured at most contexts; at each "
        "context the newest row at that chunk size whose peak was its own (a process that ran several lengths "
        "reserved pages for the longest first, so only that length's peak counts). Both plots show these rows. "
        f"The dotted line is the H200's {H200_GIB} GiB; transformers is dashed.")


def context_axis(ax, lengths: set[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(lengths)
    ax.set_xticks(ticks)
    ax.set_xticklabels([tokens(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens, log scale)")
    ax.grid(True, alpha=0.3)


def plot_modes(modes: list[tuple[str, list[dict]]], field: str, ylabel: str, title: str, path: str,
               capacity: bool = False) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.5))
    for i, (label, mine) in enumerate(modes):
        style = "--" if label.startswith("transformers") else "-"
        ax.plot([r["seq_len"] for r in mine], [r[field] for r in mine], style, marker="o", label=label,
                color=f"C{i}")
    if capacity:
        ax.axhline(H200_GIB, color="black", linestyle=":", linewidth=1, label=f"H200 memory ({H200_GIB} GiB)")
    context_axis(ax, {r["seq_len"] for _, mine in modes for r in mine} or {2**15})
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
