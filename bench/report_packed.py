"""The 'Packed documents' section."""
from __future__ import annotations

from report_common import (
    Commands, OFFLOAD, STEP_IMPLS, commit, day, newest, num, own_peaks, peak, section, shipped, step_command,
    step_rows, step_settings, table, tokens)


def select_packed(rows: list[dict]) -> list[tuple[dict, dict | None, dict | None]]:
    """For each (context, document length) an oomb step of packed documents measured at (whole
    GPU): the newest oomb row, the transformers + Liger row of its run there (the same documents
    as a batch of separate sequences), and the newest dense oomb row of the same implementation
    at that context (one document the length of the sequence), or None."""
    rows = [r for r in own_peaks(rows) if shipped(r, STEP_IMPLS.__contains__) and r.get("ok")
            and not r.get("gpu_cap_gib") and not r.get("lora_rank")]
    packed = [r for r in rows if r.get("packed_docs")]
    picked = []
    for key in sorted({(r["seq_len"], r["packed_docs"]) for r in packed if r["impl"] in OFFLOAD}):
        mine = newest([r for r in packed if (r["seq_len"], r["packed_docs"]) == key and r["impl"] in OFFLOAD])
        liger = [r for r in packed if (r["seq_len"], r["packed_docs"]) == key and r["impl"] == "liger"
                 and (commit(r), day(r)) == (commit(mine), day(mine))]
        dense = [r for r in step_rows(rows) if r["impl"] == mine["impl"] and r["seq_len"] == key[0]]
        picked.append((mine, newest(liger) if liger else None, newest(dense) if dense else None))
    return picked


def packed_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r, liger, dense in select_packed(rows):
        out.append([tokens(r["seq_len"]), tokens(r["packed_docs"]), r["seq_len"] // r["packed_docs"],
                    step_settings(r), f"{r['step_s']:.2f}", num(r["tok_s"]), peak(r),
                    "—" if liger is None else f"{liger['step_s']:.2f}", "—" if liger is None else peak(liger),
                    "—" if liger is None else f"{liger['step_s'] / r['step_s']:.2f}",
                    "—" if dense is None else f"{dense['step_s']:.2f}",
                    "—" if dense is None else f"{dense['step_s'] / r['step_s']:.2f}", commit(r), day(r),
                    ", ".join(cmds.ref(step_command(x)) for x in (r, liger, dense) if x is not None)])
    if not out:
        return ("_No rows yet: `python bench/bench_step.py --impls oomb-default,liger --lengths 128K --packed-docs 8K` "
                "and `python bench/bench_step.py --impls oomb-default,liger --lengths 128K` measure them._")
    return section("packed step", out, cmds,
        "One training step over sequences packed from documents of equal length (Qwen2.5-7B shape, full-parameter "
        "gradients): oomb takes the packed sequence with `position_ids` restarting at each document, so each "
        "document attends to itself only and the kernels skip the pages and key tiles of earlier documents; "
        "transformers + Liger takes the same documents as a batch of separate sequences; the dense oomb step "
        "is one document as long as the sequence (causal attention over all of it).",
        table(["context", "document", "documents", "oomb settings", "oomb s", "oomb tok/s", "oomb peak GiB",
               "Liger s (batch)", "Liger peak GiB", "oomb speed ÷ Liger", "oomb dense s", "dense ÷ packed",
               "commit", "date", "commands"], out),
        "Rows: for each context and document length, the newest packed oomb step, its run's Liger step, and the "
        "newest dense step of the same oomb implementation at that context.")
