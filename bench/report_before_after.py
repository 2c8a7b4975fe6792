"""The 'Before and after a change' section: bench/before_after.py's pairs."""
from __future__ import annotations

import json

from report_common import Commands, commit, day, newest, on_gpu, section, table, tokens


def select_before_after(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(before, after) row pairs of bench/before_after.py runs on GPUs that measured both trees:
    the newest pair of each before commit, context and settings."""
    rows = [r for r in on_gpu(rows) if r.get("ok")]
    pairs = {}
    for after in (r for r in rows if r["tree"] == "after"):
        before = [r for r in rows if r["tree"] == "before" and r["seq_len"] == after["seq_len"]
                  and r["date"] <= after["date"] and settings_of(r) == settings_of(after)]
        if before:
            b = newest(before)
            pairs[(b["commit"], after["seq_len"], json.dumps(settings_of(after), sort_keys=True))] = (b, after)
    return sorted(pairs.values(), key=lambda p: (p[1]["seq_len"], p[1]["date"]))


def settings_of(r: dict) -> dict:
    keys = ("model", "lora_rank", "chunk_size", "page_size", "backend", "offload", "sparse_budget", "kv_grad_dtype",
            "checkpoint_layers", "compile", "keep_attention", "param_grad_dtype", "repeats")
    return {k: r.get(k) for k in keys}


def before_after_command(r: dict) -> str:
    flags = [f"--lengths {tokens(r['seq_len'])}", f"--chunk-size {r['chunk_size']}"]
    flags += [f"--{k.replace('_', '-')} {r[k]}" for k, default in (
        ("model", "qwen2.5-7b"), ("lora_rank", 0), ("offload", "none"), ("sparse_budget", 0),
        ("kv_grad_dtype", "fp32"), ("param_grad_dtype", "param"), ("repeats", 1)) if r.get(k, default) != default]
    flags += [f"--{k.replace('_', '-')}" for k in ("checkpoint_layers", "compile", "keep_attention") if r.get(k)]
    return f"python bench/before_after.py --before DIR --before-commit {commit(r)} " + " ".join(flags)


def before_after_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for before, after in select_before_after(rows):
        out.append([tokens(after["seq_len"]), commit(before), commit(after), f"{before['median_s']:.2f}",
                    f"{after['median_s']:.2f}", f"{after['time_vs_before']:.3f}",
                    "yes" if after["grads_equal_before"] else "**no**", day(after),
                    cmds.ref(before_after_command(before))])
    if not out:
        return ("_No rows yet: `python bench/before_after.py --before DIR --lengths 64K --chunk-size 8192 --compile "
                "--keep-attention` (DIR: `git archive <commit> src | tar -x -C DIR`) measures them._")
    return section("before/after pair", out, cmds,
        "The same step (model, tokens, settings) run by an earlier commit's tree and this one's, each in its own "
        "process in the same command (`bench/before_after.py`): the median step time of each, their ratio, and "
        "whether every parameter's gradient is bitwise the same.",
        table(["context", "before", "after", "before s", "after s", "after ÷ before", "gradients bitwise equal",
               "date", "command"], out),
        "Rows: the newest pair of each earlier commit, context and settings.")
