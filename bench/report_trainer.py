"""The 'The trainer end to end' section: `oomb train` beside its engine-only step."""
from __future__ import annotations

from report_common import (
    Commands, TRAINER_IMPLS, commit, day, newest, newest_each, num, section, shipped, step_command, step_rows,
    table, tokens)


def select_trainer(rows: list[dict]) -> list[tuple[dict, dict | None]]:
    """The newest `oomb train` row (oomb-train, oomb-sparse-train) of each kind, model, LoRA rank
    and context, with the engine-only step of the same choice there (oomb-default,
    oomb-sparse-default: the same model whole, on the whole GPU): the newest of the trainer's own
    commit, else the newest of any; or None."""
    runs = [r for r in rows if shipped(r, TRAINER_IMPLS.__contains__) and r.get("ok")]
    pairs = []
    for r in sorted(newest_each(runs, lambda r: (r["impl"], r["model"], r.get("lora_rank", 0), r["seq_len"])),
                    key=lambda r: (r["model"], r.get("lora_rank", 0), r["impl"], r["seq_len"])):
        engine = [e for e in step_rows(rows) if e["impl"] == TRAINER_IMPLS[r["impl"]] and e["seq_len"] == r["seq_len"]
                  and e.get("model", "qwen2.5-7b") == r["model"] and e.get("layers") == r["layers"]
                  and e.get("lora_rank", 0) == r.get("lora_rank", 0)]
        same = [e for e in engine if e.get("commit") == r.get("commit")]
        pairs.append((r, newest(same or engine) if engine else None))
    return pairs


def trainer_section(rows: list[dict]) -> str:
    cmds, out, pairs = Commands(), [], select_trainer(rows)
    if not pairs:
        return ("_No rows yet: `python bench/bench_step.py --impls oomb-default,oomb-train --lengths 64K` and "
                "`python bench/bench_step.py --impls oomb-sparse-default,oomb-sparse-train --lengths 1M` measure "
                "them._")
    for r, e in pairs:
        ref = cmds.ref(step_command(r)) + ("" if e is None else ", " + cmds.ref(step_command(e)))
        beside = ["—"] * 3 if e is None else [f"{e['step_s']:.2f}", commit(e), f"{e['step_s'] / r['step_s']:.3f}"]
        what = f"LoRA r={r['lora_rank']}" if r.get("lora_rank") else "full"
        out.append([tokens(r["seq_len"]), f"{r['model']}, {what}", "top-k 64" if r.get("sparse_budget") else "dense",
                    str(len(r["trainer_step_s"])), f"{r['trainer_step_s'][0]:.2f}", f"{r['step_s']:.2f}",
                    num(r["tok_s"]), f"{r['peak_gib']:.1f}", *beside, commit(r), day(r), ref])
    return section("trainer", out, cmds,
        "`oomb train` itself, with no flags but the model, the context and top-k: each optimizer step as its "
        "metrics.jsonl logs it (the batch, forward and backward, gradient clipping, AdamW's step), the first "
        "(which compiles and warms up) apart from the median of the rest; beside it the engine-only step of "
        "the same automatic choice (forward and backward alone, the dense-step and top-k tables' oomb-default "
        "rows): the newest of the trainer's own commit, else the newest of any.",
        table(["context", "model", "attention", "steps", "first step s", "step s", "tok/s", "peak GiB",
               "engine-only step s", "its commit", "engine-only ÷ trainer", "commit", "date", "commands"], out))
