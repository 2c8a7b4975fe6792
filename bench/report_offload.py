"""The 'Offload overhead' section: offload 'all' beside a step that kept its pages on the GPU."""
from __future__ import annotations

from report_common import (
    Commands, OFFLOAD, base_options, commit, day, kept, newest, num, peak, section, step_command, step_rows,
    step_settings, table, tokens)


def same_settings(a: dict, b: dict) -> bool:
    keys = ("chunk_size", "kv_grad_dtype", "checkpoint_layers", "compile", "group_pages", "lora_rank")
    return all(a.get(k) == b.get(k) for k in keys) and kept(a) == kept(b) and ("sparse" in a["impl"]) == (
        "sparse" in b["impl"])


def select_offload(rows: list[dict]) -> list[tuple[dict, dict]]:
    """For each attention kind and context: the newest offload 'all' step; beside it, the newest
    step of the same settings that kept every page on the GPU ('none', or 'auto' that put no layer
    on the host), from the same run (commit and day) when there is one; else 'auto' with host layers."""
    rows = [r for r in step_rows(rows) if base_options(r) and r["impl"] in OFFLOAD]
    out = []
    for sparse in (False, True):
        alls = [r for r in rows if OFFLOAD[r["impl"]] == "all" and ("sparse" in r["impl"]) == sparse]
        for n in sorted({r["seq_len"] for r in alls}):
            a = newest([r for r in alls if r["seq_len"] == n])
            like = [r for r in rows if r["seq_len"] == n and OFFLOAD[r["impl"]] != "all" and same_settings(a, r)]
            on_gpu = [r for r in like if OFFLOAD[r["impl"]] == "none" or not r.get("host_layers")]
            for pool in (on_gpu, like):
                same_run = [r for r in pool if (commit(r), day(r)) == (commit(a), day(a))]
                if same_run or pool:
                    out.append((a, newest(same_run or pool)))
                    break
    return out


def offload_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for a, b in select_offload(rows):
        where = f"'{OFFLOAD[b['impl']]}'" + (f", {b['host_layers']} host layers" if b.get("host_layers") else "")
        out.append(["top-k" if "sparse" in a["impl"] else "dense", tokens(a["seq_len"]), f"{a['step_s']:.2f}",
                    peak(a), num(a.get("host_peak_gib"), ".1f"), where, f"{b['step_s']:.2f}", peak(b),
                    f"{a['step_s'] / b['step_s'] - 1:+.1%}", step_settings(a),
                    f"{commit(a)} / {commit(b)}", f"{day(a)} / {day(b)}",
                    f"{cmds.ref(step_command(a))}, {cmds.ref(step_command(b))}"])
    return section("offload", out, cmds,
        "Offload 'all' keeps every layer's K/V pages (and dK/dV) in pinned host memory, loading each layer's "
        "pages while the layer before it computes; the gradients equal those of 'none' bit for bit "
        "(`bench/bench_offload.py` checks it; `pytest -m gpu tests/test_gpu_engine.py` too).",
        table(["attention", "context", "'all' s", "'all' peak GiB", "'all' host GiB", "beside", "s", "peak GiB",
               "'all' overhead", "settings", "commits ('all' / beside)", "dates", "commands"], out),
        "Rows: for each attention kind and context, the newest 'all' step, beside the newest step of the same "
        "settings that kept every page on the GPU, from the same run when there is one (where none fits, as at "
        "1M, 'auto' with some layers on the host).")
