"""The 'Longest context' section: the longest context a measured step reached, and the longest
the plan fits.
"""
from __future__ import annotations

from collections import defaultdict

from report_common import (
    Commands, H200_GIB, OFFLOAD, PRESET_LAYERS, commit, day, newest, num, peak, section, step_command, step_rows,
    step_settings, table)
from report_plan import PLAN_HOST_GIB, planned_longest


def select_longest(rows: list[dict]) -> list[dict]:
    """For each model, kind of gradients (full or LoRA) and attention (dense or top-k): the longest
    context an oomb step finished at, the newest row there."""
    rows = [r for r in step_rows(rows) if r["impl"] in OFFLOAD
            and r.get("layers") == PRESET_LAYERS.get(r.get("model", "qwen2.5-7b"))]
    groups = defaultdict(list)
    for r in rows:
        groups[(r.get("model", "qwen2.5-7b"), bool(r.get("lora_rank")), "sparse" in r["impl"])].append(r)
    picked = []
    for g in groups.values():
        longest = max(r["seq_len"] for r in g)
        picked.append(newest([r for r in g if r["seq_len"] == longest]))
    return sorted(picked, key=lambda r: (r.get("model", "qwen2.5-7b") != "qwen2.5-7b", r.get("model", "qwen2.5-7b"),
                                         bool(r.get("lora_rank")), "sparse" in r["impl"]))


def longest_section(rows: list[dict]) -> str:
    cmds, out, planned = Commands(), [], []
    for r in select_longest(rows):
        if r.get("model", "qwen2.5-7b").startswith("qwen2.5"):
            longest = planned_longest(r)
            planned.append([r.get("model", "qwen2.5-7b"), f"LoRA r={r['lora_rank']}" if r.get("lora_rank") else "full",
                            "top-k" if "sparse" in r["impl"] else "dense", f"'{OFFLOAD[r['impl']]}', " + step_settings(r),
                            f"{longest:,}", f"{r['seq_len']:,}", peak(r), f"{100 * r['peak_gib'] / H200_GIB:.1f} %"
                            if r.get("peak_gib") else "—", commit(r), day(r), cmds.ref(step_command(r))])
        out.append([r.get("model", "qwen2.5-7b"), f"LoRA r={r['lora_rank']}" if r.get("lora_rank") else "full",
                    "top-k" if "sparse" in r["impl"] else "dense", f"{r['seq_len']:,}", f"{r['step_s']:.1f}",
                    num(r["tok_s"]), peak(r), num(r.get("host_peak_gib"), ".1f"), f"'{OFFLOAD[r['impl']]}', "
                    + step_settings(r), commit(r), day(r), cmds.ref(step_command(r))])
    measured = {row[0] for row in planned}
    topk = {"impl": "oomb-sparse-auto", "chunk_size": 4096, "kv_grad_dtype": "bf16", "checkpoint_layers": True}
    unmeasured = ", ".join(f"{model} {planned_longest({**topk, 'model': model}):,} tokens"
                           for model in ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b") if model not in measured)
    return section("step", out, cmds,
        "The longest context a measured step reached, per model, kind of gradients and attention. "
        "`oomb plan --seq-len N` estimates the GPU and host memory of other lengths before a run.",
        table(["model", "gradients", "attention", "tokens", "s / step", "tok/s", "peak GPU GiB", "host GiB",
               "offload, settings", "commit", "date", "command"], out),
        "Rows: for each model, kind of gradients and attention, the longest context among the rows; the "
        "newest row there.",
        f"The plan beside the measurement: the longest context `oomb plan` says each of those steps fits on one H200 "
        f"({H200_GIB} GiB, 5 % of it left free) with {PLAN_HOST_GIB} GiB of pinned host memory (gradients only, as "
        "the measured step; `oomb plan --model M --seq-len N --optimizer none` with the row's settings), computed "
        "from the code of this page's commit.",
        table(["model", "gradients", "attention", "offload, settings", "plan: longest tokens", "measured tokens",
               "measured peak GPU GiB", "of the GPU", "commit", "date", "command"], planned)
        + (f"\n\nShapes no step has measured, planned with full-parameter gradients, top-k, 'auto', chunk 4096, "
           f"bf16 dK/dV and layers recomputed: {unmeasured}." if unmeasured else ""))
