"""The 'GPT-OSS' section."""
from __future__ import annotations

from report_common import (
    Commands, commit, day, newest_each, num, peak, section, step_command, step_rows, step_settings, table, tokens)


def select_gpt_oss(rows: list[dict]) -> list[dict]:
    """GPT-OSS-20B steps: the newest row of each implementation and settings at each context."""
    rows = [r for r in step_rows(rows) if r.get("model") == "gpt-oss-20b"]
    return sorted(newest_each(rows, lambda r: (r["impl"], step_settings(r), r["seq_len"])),
                  key=lambda r: (r["impl"], r["seq_len"]))


def gpt_oss_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r in select_gpt_oss(rows):
        out.append([tokens(r["seq_len"]), r["impl"], step_settings(r), f"{r['step_s']:.2f}", num(r["tok_s"]), peak(r),
                    num(r.get("host_peak_gib"), ".1f"), commit(r), day(r), cmds.ref(step_command(r))])
    return section("GPT-OSS", out, cmds,
        "GPT-OSS-20B shape (24 layers, mixture of experts, sliding-window layers between full-attention ones), "
        "random bf16 weights, LoRA adapters on attention with the base frozen; top-k on the full-attention layers, "
        "while each sliding-window layer keeps one page per chunk.",
        table(["context", "implementation", "settings", "s / step", "tok/s", "peak GPU GiB", "host GiB", "commit",
               "date", "command"], out),
        "Rows: the newest row of each implementation and settings at each context.")
