"""The 'Dense step vs transformers and Liger' section."""
from __future__ import annotations

from report_common import (
    Commands, base_options, commit, day, newest, num, peak, section, step_command, step_rows, step_settings, table,
    tokens)


def select_dense_steps(rows: list[dict]) -> list[tuple[dict, dict]]:
    """For each context and each of tuned (offload 'none' with flags) and default (what oomb
    train chooses: oomb-default) dense oomb steps (the whole preset, full-parameter gradients):
    the newest run (commit and day) with such a step there; each such row of that run, with the
    run's transformers + Liger row there nearest in time (or None)."""
    rows = [r for r in step_rows(rows) if base_options(r) and not r.get("lora_rank")]
    pairs = []
    for n in sorted({r["seq_len"] for r in rows if r["impl"] in ("oomb", "oomb-default")}):
        for impl in ("oomb", "oomb-default"):
            at_n = [r for r in rows if r["impl"] == impl and r["seq_len"] == n]
            if not at_n:
                continue
            run = (commit(newest(at_n)), day(newest(at_n)))
            liger = [r for r in rows if r["impl"] == "liger" and r["seq_len"] == n and (commit(r), day(r)) == run]
            for r in sorted((r for r in at_n if (commit(r), day(r)) == run), key=lambda r: r["date"]):
                near = min(liger, key=lambda b: abs(minutes(b) - minutes(r)), default=None)
                pairs.append((r, near))
    return pairs


def minutes(r: dict) -> int:
    hh, mm = r["date"][11:13], r["date"][14:16]
    return int(hh) * 60 + int(mm)


def dense_step_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r, liger in select_dense_steps(rows):
        ref = cmds.ref(step_command(r)) + ("" if liger is None else ", " + cmds.ref(step_command(liger)))
        beside = (["—"] * 4 if liger is None else
                  [f"{liger['step_s']:.2f}", num(liger["tok_s"]), peak(liger), f"{liger['step_s'] / r['step_s']:.3f}"])
        out.append([tokens(r["seq_len"]), step_settings(r), f"{r['step_s']:.2f}", num(r["tok_s"]), peak(r), *beside,
                    commit(r), day(r), ref])
    hf = "" if any(r["impl"] == "hf" for r in step_rows(rows)) else (
        " No row measures transformers without Liger on a GPU (`--impls hf`).")
    return section("dense step", out, cmds,
        "One training step (forward and backward, no optimizer step) of the Qwen2.5-7B shape, full-parameter "
        "gradients, against transformers with SDPA, gradient checkpointing and Liger's Triton kernels "
        "(RoPE, RMSNorm, SwiGLU, fused linear cross entropy), each in its own process, one after the other in "
        "the same run." + hf,
        table(["context", "oomb settings", "oomb s", "oomb tok/s", "oomb peak GiB", "Liger s", "Liger tok/s",
               "Liger peak GiB", "oomb speed ÷ Liger", "commit", "date", "commands"], out),
        "Rows: for each context, the newest run (commit and day) that timed a tuned dense oomb step there (flags "
        "set by hand) and the newest that timed oomb train's own choice (oomb-default, no flags): each such oomb "
        "step, beside its run's Liger step nearest in time. oomb-default plans room for AdamW's state (bf16 "
        "moments: 28.4 GiB for the 7B), which neither the tuned steps nor Liger's hold. A peak shown as — was not "
        "the step's own (the process had reserved pages for a longer context).")
