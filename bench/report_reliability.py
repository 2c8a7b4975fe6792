"""The 'Long runs and sanitizers' section: soak runs and compute-sanitizer."""
from __future__ import annotations

import re

from report_common import Commands, commit, day, newest_each, on_gpu, section, table, tokens

SOAK_SERIES = [("gpu_alloc_gib", "GPU allocated"), ("gpu_reserved_gib", "GPU reserved"), ("host_rss_gib", "host RSS"),
               ("pinned_gib", "pinned")]


def select_soak(rows: list[dict]) -> list[dict]:
    """soak.py rows on GPUs with a verdict (a run stopped after its baseline step has none): the
    newest of each model, context and mode."""
    key = lambda r: (r["model"], r["seq_len"], r["mode"])  # noqa: E731
    return sorted(newest_each([r for r in on_gpu(rows) if r.get("flat") is not None], key), key=key)


def select_sanitize(rows: list[dict]) -> list[dict]:
    """sanitize.py rows on GPUs: the newest of each kernel and tool."""
    key = lambda r: (r["kernel"], r["tool"])  # noqa: E731
    return sorted(newest_each(on_gpu(rows), key), key=key)


def without_results(cmd: str) -> str:
    """A bench command as it reproduces the row (its --results path was the run's own)."""
    return re.sub(r" --results \S+", "", cmd)


def growth(g: dict) -> str:
    pct = f" ({g['growth_pct']:+.2f} %)" if g.get("growth_pct") is not None else ""
    return f"{g['baseline_gib']:.2f}, {g['growth_gib']:+.3f}{pct}"


def reliability_section(soak: list[dict], sanitize: list[dict]) -> str:
    cmds, out = Commands(), []
    for r in select_soak(soak):
        median = sorted(r["step_s"])[len(r["step_s"]) // 2]
        out.append([r["model"], tokens(r["seq_len"]), r["mode"], f"{r['steps']}", f"{median:.1f}",
                    *(growth(r["growth"][k]) for k, _ in SOAK_SERIES), "flat" if r["flat"] else "**grows**",
                    commit(r), day(r), cmds.ref(without_results(r["command"]))])
    checks = []
    for r in select_sanitize(sanitize):
        found = r.get("hazards", r.get("errors", 0)) if r["tool"] == "racecheck" else r.get("errors", 0)
        checks.append([r["kernel"], r["tool"], r["status"], f"{found}", r.get("summary", ""), commit(r), day(r),
                       cmds.ref(f"python bench/sanitize.py --kernels {r['kernel']} --tools {r['tool']}")])
    return section("soak or sanitizer", out + checks, cmds,
        "Soak (`bench/soak.py`): `oomb train` for many steps, with the GPU's allocated and reserved memory and "
        "the process's resident and pinned host memory recorded after every step. Each series' baseline is "
        "its value after step 2; growth is the largest later value less the baseline (GiB, and % of the "
        "baseline); flat is growth <= max(1 %, 0.01 GiB) in every series.",
        table(["model", "context", "attention, offload", "steps", "median s / step",
               *(f"{name} GiB (baseline, growth)" for _, name in SOAK_SERIES), "verdict", "commit", "date",
               "command"], out) if out else "_No soak rows._",
        "Sanitizers (`bench/sanitize.py`): compute-sanitizer's memcheck, racecheck and synccheck on each kernel "
        "alone, at small shapes. The ws-control kernels are controls: Triton's warp specialisation with no data "
        "of their own (-bar adds the default partition's barrier, -mbarrier mbarriers, -capture a captured "
        "value, -all the three). racecheck flags hopper-backward on the bytes of Triton's warp-specialisation "
        "state only, and flags ws-control-bar, which has nothing else, on the same state: the hazards are the "
        "tool's reading of Triton's hand-off, not of the kernel's buffers ([experiments](experiments.md), "
        "\"Racecheck on the Gluon backward\").",
        table(["kernel", "tool", "status", "errors / hazards", "summary", "commit", "date", "command"], checks)
        if checks else "_No sanitizer rows._",
        "Rows: the newest soak row of each model, context and mode; the newest sanitizer row of each kernel and "
        "tool.")
