"""The 'Several GPUs' section: tensor and data parallelism under torchrun."""
from __future__ import annotations

from report_common import (
    Commands, PARALLEL_IMPLS, commit, day, newest_each, num, parallel_command, section, shipped, table, tokens)


def select_parallel(rows: list[dict]) -> list[dict]:
    """bench_parallel.py rows on GPUs: the newest of each (attention, model, GPUs, TP, context);
    steps that a time limit cut are kept, with the passes they finished."""
    rows = [r for r in rows if shipped(r, PARALLEL_IMPLS.__contains__)]
    return sorted(newest_each(rows, lambda r: (r["impl"], r["model"], r["layers"], r["world"], r["tp"], r["seq_len"])),
                  key=lambda r: (r["impl"] != "sparse", r["seq_len"], r["tp"], r["world"]))


def parallel_settings(r: dict) -> str:
    s = [f"chunk {r['chunk_size']}"]
    if r.get("group_pages"):
        s.append(f"{r['group_pages']} pages a call")
    s += [f"offload '{r['offload']}'", f"{r['kv_grad_dtype']} dK/dV"]
    if r.get("compile"):
        s.append("compiled")
    if r.get("keep_attention") not in (None, "no"):
        s.append(f"keep_attention={r['keep_attention']}")
    return ", ".join(s)


def parallel_table(rows: list[dict], cmds: Commands) -> str:
    """DP efficiency: tokens/s per GPU against the 1-GPU row of the same commit, attention and context."""
    single = {(commit(r), r["impl"], r["seq_len"]): r["tok_s_per_gpu"]
              for r in rows if r["world"] == 1 and r.get("ok")}
    out = []
    for r in rows:
        base = single.get((commit(r), r["impl"], r["seq_len"]))
        if r.get("ok"):
            timing = [f"{r['step_s']:.2f}", num(r["tok_s"]), num(r["tok_s_per_gpu"]),
                      f"{r['tok_s_per_gpu'] / base:.1%}" if base and r["tp"] == 1 and r["world"] > 1 else "",
                      num(r.get("peak_gib"), ".1f")]
        else:
            timing = [f"not finished: {r.get('passes_done')} of {r.get('passes')} chunk passes in "
                      f"{r.get('elapsed_s')} s", "—", "—", "", "—"]
        out.append(["top-k" if r["impl"] == "sparse" else "dense", r["world"], f"{r['tp']} x {r['dp']}",
                    tokens(r["seq_len"]), parallel_settings(r), *timing, commit(r), day(r),
                    cmds.ref(parallel_command(r))])
    return table(["attention", "GPUs", "TP x DP", "context", "settings", "s / step", "tok/s", "tok/s per GPU",
                  "DP efficiency", "peak GiB per GPU", "commit", "date", "command"], out)


def parallel_section(rows: list[dict]) -> str:
    picked = select_parallel(rows)
    cmds = Commands()
    return section("multi-GPU", picked, cmds,
        "Qwen2.5-7B shape, full-parameter gradients, under `torchrun` on one host (H200s linked by NVLink): "
        "tensor-parallel ranks (TP) share each sequence, each holding its share of the heads; data-parallel "
        "ranks (DP) take a sequence each and all-reduce the gradients after the step (in the time). Peak memory "
        "is the largest over the ranks.",
        parallel_table(picked, cmds),
        "Rows: the newest row of each attention, GPU count, TP size and context. DP efficiency is tokens/s per "
        "GPU against the 1-GPU row of the same commit. A step cut by its command's time limit shows the chunk "
        "passes it finished (of n - 1 in stage 1 and n in stage 2).")
