"""`--task loss`: the mean cross entropy per predicted token."""
from __future__ import annotations

from ..engine import ChunkRecurrentEngine
from .inputs import BATCHES, Batches, eval_batches
from .registry import EvalTask


def mean_loss(engine: ChunkRecurrentEngine, batches: Batches, progress=None) -> dict:
    total, tokens = 0.0, 0
    for ids, labels, *positions in batches:
        r = engine.evaluate(ids, labels, progress=progress, position_ids=positions[0] if positions else None)
        total += float(r.loss) * r.num_tokens
        tokens += r.num_tokens
    if not tokens:
        raise ValueError("no tokens to evaluate")
    return {"task": "loss", "tokens": tokens, "loss": total / tokens}


def report(r: dict) -> list[str]:
    return [f"loss {r['loss']:.4f} over {r['tokens']:,} tokens"]


TASK = EvalTask(
    "loss", "mean cross entropy per predicted token",
    run=lambda args, engine, progress: mean_loss(engine, eval_batches(args, engine.adapter.vocab_size), progress),
    report=report, flags={"--batches": BATCHES})
