"""The 'Kernels vs cuDNN' section: the paged and top-k attention kernels beside SDPA."""
from __future__ import annotations

from collections import defaultdict

from report_common import (
    ATTENTION_IMPL, Commands, attention_command, commit, day, newest, section, shipped, table, tokens)


def select_kernels(rows: list[dict]) -> list[dict]:
    """For each key count: the newest bench_attention.py invocation (commit and date) that timed the
    paged kernels beside cuDNN there (dense), and the newest that timed the top-k kernels there.
    Returns one entry per (kind, keys) with that invocation's row of each implementation."""
    rows = [r for r in rows if shipped(r, ATTENTION_IMPL.fullmatch) and "error" not in r
            and r.get("fwd_ms") and r.get("bwd_ms")]
    runs = defaultdict(lambda: defaultdict(dict))  # (kind, keys) -> invocation -> impl -> row
    for r in rows:
        kind = "dense" if r["impl"] in ("paged", "sdpa_cudnn", "sdpa_flash") else r["impl"]
        runs[(kind, r["N"])][(r["commit"], r["date"])][r["impl"]] = r
    picked = []
    for (kind, n), by_run in runs.items():
        need = {"paged", "sdpa_cudnn"} if kind == "dense" else {kind}
        complete = [run for run in by_run.values() if need <= set(run)]
        if complete:
            picked.append({"kind": kind, "N": n, **max(complete, key=lambda run: newest(list(run.values()))["date"])})
    return sorted(picked, key=lambda e: (e["kind"] != "dense", e["kind"], e["N"]))


def kernels_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for e in select_kernels(rows):
        paged = e["paged" if e["kind"] == "dense" else e["kind"]]
        cudnn, flash = e.get("sdpa_cudnn"), e.get("sdpa_flash")
        what = "dense" if e["kind"] == "dense" else f"top-k {paged.get('sparse_budget')} pages"

        def pair(r, key="tflops"):
            return "—" if r is None else f"{r['fwd_' + key]:.0f} / {r['bwd_' + key]:.0f}"

        ratio = "—" if cudnn is None else (f"{paged['fwd_tflops'] / cudnn['fwd_tflops']:.2f} / "
                                           f"{paged['bwd_tflops'] / cudnn['bwd_tflops']:.2f}")
        out.append([tokens(e["N"]), what, pair(paged), f"{paged['fwd_ms']:.2f} / {paged['bwd_ms']:.2f}", pair(cudnn),
                    ratio, pair(flash), commit(paged), day(paged), cmds.ref(attention_command(paged))])
    return section("kernel", out, cmds,
        "4,096 queries (28 heads, 4 KV heads, head_dim 128, bf16, pages of 128 keys) against N earlier keys, "
        "forward and backward timed apart (`bench/bench_attention.py`). The paged kernel also computes the "
        "chunk's own causal part, counted in its FLOPs; SDPA (cuDNN, and FlashAttention-2 as `sdpa_flash`) runs "
        "non-causal over contiguous K/V of the earlier keys. Backward FLOPs are 2.5x the forward's. Top-k rows "
        "count the selected keys only; SDPA has no top-k.",
        table(["keys", "attention", "paged TFLOP/s fwd / bwd", "paged ms fwd / bwd", "cuDNN TFLOP/s fwd / bwd",
               "paged ÷ cuDNN fwd / bwd", "FA2 TFLOP/s fwd / bwd", "commit", "date", "command"], out),
        "Rows: for each key count, the newest `bench_attention.py` run that timed the paged kernels beside "
        "cuDNN (dense) or the top-k kernels alone; the ratio compares rows of the same run.")
