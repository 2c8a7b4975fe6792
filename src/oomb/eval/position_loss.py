"""`--task position-loss`: mean cross entropy by the target's position in the sequence; a model
that uses its context keeps lowering it further along (ProLong's loss-by-position curves)."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..engine import ChunkRecurrentEngine
from ..units import parse_tokens
from .inputs import BATCHES, Batches, eval_batches
from .registry import EvalTask


def default_buckets(seq_len: int) -> list[int]:
    """Bucket starts 0, 1, 2, 4, ... (powers of two below seq_len); the last bucket ends at seq_len."""
    return [0] + [2**k for k in range(int(math.log2(max(1, seq_len - 1))) + 1) if 2**k < seq_len]


def check_buckets(starts: list[int], seq_len: int) -> list[int]:
    if not starts or starts != sorted(set(starts)) or starts[0] < 0 or starts[-1] >= seq_len:
        raise ValueError(f"--buckets {','.join(map(str, starts))}: bucket starts must be increasing, >= 0 and < "
                         f"seq_len={seq_len:,} (the last bucket ends at seq_len)")
    return starts


def position_loss(engine: ChunkRecurrentEngine, batches: Batches, seq_len: int, starts: list[int] | None = None,
                  progress=None) -> dict:
    """Mean cross entropy of the targets at positions [start, end) of each bucket (position p: the
    token at p predicted from tokens < p; p = 0 is never a target); empty buckets are left out.
    Packed batches bucket each target by its position in its own document."""
    starts = check_buckets(starts if starts is not None else default_buckets(seq_len), seq_len)
    edges = starts + [seq_len]
    sums = np.zeros(len(starts), dtype=np.float64)
    counts = np.zeros(len(starts), dtype=np.int64)
    for ids, labels, *positions in batches:
        if ids.shape[1] != seq_len:
            raise ValueError(f"a batch of {ids.shape[1]} tokens; position-loss compares sequences of seq_len={seq_len}")
        pos = positions[0] if positions else None
        ce = engine.evaluate(ids, labels, progress=progress, per_token=True, position_ids=pos).token_losses.cpu()
        valid = ~torch.isnan(ce)
        at = torch.arange(seq_len).expand_as(ce) if pos is None else pos.cpu()
        for j in range(len(starts)):
            ok = valid & (at >= edges[j]) & (at < edges[j + 1])
            sums[j] += float(ce[ok].double().sum())
            counts[j] += int(ok.sum())
    if not counts.sum():
        raise ValueError("no tokens to evaluate")
    buckets = [{"start": edges[j], "end": edges[j + 1], "tokens": int(counts[j]), "loss": sums[j] / counts[j]}
               for j in range(len(starts)) if counts[j]]
    return {"task": "position-loss", "seq_len": seq_len, "tokens": int(counts.sum()),
            "loss": float(sums.sum() / counts.sum()), "buckets": buckets}


def report(r: dict) -> list[str]:
    return [f"loss {r['loss']:.4f} over {r['tokens']:,} tokens; by position:"] + [
        f"  [{b['start']:>9,}, {b['end']:>9,})  {b['tokens']:>10,} tokens  loss {b['loss']:.4f}" for b in r["buckets"]]


def plot(result: dict, label: str, path: str) -> None:
    from . import plots

    plots.position_loss({label: result}, path)


TASK = EvalTask(
    "position-loss", "loss by the target's position (buckets)",
    run=lambda args, engine, progress: position_loss(engine, eval_batches(args, engine.adapter.vocab_size),
                                                     args.seq_len, args.buckets, progress),
    report=report, plot=plot,
    flags={"--batches": BATCHES,
           "--buckets": {"type": lambda t: [parse_tokens(x, low=0) for x in t.split(",")], "default": None,
                         "help": "bucket starts, e.g. 0,1024,4096 (default: 0 and powers of two up to seq_len)"}})
