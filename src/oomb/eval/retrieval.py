"""`--task retrieval`: key-value needles at given depths of held-out text, queried at the end; a
hit when every value token is the argmax prediction (teacher-forced). A grid of accuracy by
context length and depth (RULER's, needle-in-a-haystack's heatmap)."""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from ..data.needles import DEFAULT_TEMPLATE, hits, make_needle, with_needles
from ..engine import ChunkRecurrentEngine
from ..flags import at_least
from ..loss import IGNORE_INDEX
from ..units import parse_tokens
from .registry import EvalTask


def retrieval(engine: ChunkRecurrentEngine, haystack: np.ndarray | None, codec, lengths: list[int],
              depths: list[float], samples: int = 4, template: str = DEFAULT_TEMPLATE, seed: int = 0,
              batch: int = 0, progress=None) -> dict:
    """Key-value needle retrieval: for each length and depth, `samples` sequences of held-out text
    (sample s of length L: the haystack's window [s L, (s + 1) L)), one needle at the depth and its
    query at the end. `haystack` None: random tokens (tests). batch: sequences per evaluate call
    (0: all samples of a cell at once)."""
    for d in depths:
        if not 0 <= d <= 1:
            raise ValueError(f"--depths {d}: depths are fractions of the context, 0 (start) to 1 (end)")
    need = max(lengths) * samples
    if haystack is not None and len(haystack) < need:
        raise ValueError(f"the haystack file holds {len(haystack):,} tokens; {samples} samples at {max(lengths):,} "
                         f"tokens need {need:,}: use fewer --samples, shorter --lengths or a larger file")
    vocab = engine.adapter.vocab_size
    grid, cells = [], []
    for length in lengths:
        row = []
        for depth in depths:
            seqs, answers = retrieval_cell(haystack, codec, template, length, depth, samples, seed, vocab)
            found, losses = [], []
            step = batch or samples
            for first in range(0, samples, step):
                ids = torch.from_numpy(np.stack(seqs[first : first + step]))
                labels = torch.full_like(ids, IGNORE_INDEX)
                for b, (s0, s1) in enumerate(answers[first : first + step]):
                    labels[b, s0:s1] = ids[b, s0:s1]
                r = engine.evaluate(ids, labels, progress=progress, per_token=True)
                pred, ce = r.predictions.cpu().numpy(), r.token_losses.cpu().numpy()
                for b, span in enumerate(answers[first : first + step]):
                    found += hits(pred[b], ids[b].numpy(), [span])
                    losses.append(float(np.nanmean(ce[b, span[0] : span[1]])))
            accuracy = sum(found) / samples
            row.append(accuracy)
            cells.append({"length": length, "depth": depth, "samples": samples, "hits": int(sum(found)),
                          "accuracy": accuracy, "answer_loss": float(np.mean(losses))})
        grid.append(row)
    return {"task": "retrieval", "lengths": lengths, "depths": depths, "samples": samples, "template": template,
            "accuracy": grid, "mean_accuracy": float(np.mean(grid)), "cells": cells}

def retrieval_cell(haystack: np.ndarray | None, codec, template: str, length: int, depth: float, samples: int,
                   seed: int, vocab: int) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """The sequences of one (length, depth) cell and each one's answer span: sample s hides one
    needle (drawn from a generator seeded by seed, length, depth and s) in the haystack's window
    [s length, (s + 1) length), or in random tokens when there is no haystack."""
    seqs, answers = [], []
    for s in range(samples):
        rng = np.random.default_rng([seed, length, round(depth * 10_000), s])
        text = haystack[s * length : (s + 1) * length] if haystack is not None else rng.integers(0, vocab, length)
        tokens, spans = with_needles(np.asarray(text), [make_needle(codec, template, rng)], [depth], length)
        seqs.append(tokens)
        answers.append(spans[0])
    return seqs, answers



def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]: needle depths, each a number from 0 (start) to 1 (end)."""
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        depths = [math.nan]
    if not all(0 <= d <= 1 for d in depths):
        raise argparse.ArgumentTypeError(f"{text!r} must be depths from 0 (start) to 1 (end), e.g. 0,0.5,1")
    return depths


def run(args: argparse.Namespace, engine: ChunkRecurrentEngine, progress) -> dict:
    """The needles hide in --data's first windows of each length (random tokens for 'copy'),
    encoded by --tokenizer (else the model's own tokenizer, or bytes)."""
    from ..data.codec import codec_for
    from ..data.tokens import load_tokens

    vocab = engine.adapter.vocab_size
    haystack = None if args.data == "copy" else load_tokens(args.data, vocab, max(args.lengths), args.data_dtype)
    codec = codec_for(args.tokenizer, args.model, vocab)
    return retrieval(engine, haystack, codec, args.lengths, args.depths, args.samples,
                     args.needle_template.replace("\\n", "\n"), args.seed, args.batch, progress)


def report(r: dict) -> list[str]:
    return [f"mean accuracy {r['mean_accuracy']:.3f} ({r['samples']} samples a cell)",
            "  length \\ depth " + "".join(f"{d:>7g}" for d in r["depths"])] + [
        f"  {n:>14,} " + "".join(f"{a:>7.2f}" for a in row) for n, row in zip(r["lengths"], r["accuracy"])]


def plot(result: dict, label: str, path: str) -> None:
    from . import plots

    plots.retrieval(result, path, f"retrieval: {label}")


TASK = EvalTask(
    "retrieval", "key-value needles by context length and depth",
    run=run, report=report, plot=plot, longest=lambda args: max(args.lengths),
    settings={"needle_template": {}, "tokenizer": {}},
    flags={"--lengths": {"type": lambda t: [parse_tokens(x) for x in t.split(",")], "default": [4096],
                         "help": "context lengths, e.g. 16K,64K,256K"},
           "--depths": {"type": parse_depths, "default": [0, 0.25, 0.5, 0.75, 1],
                        "help": "needle depths (0: start, 1: end)"},
           "--samples": {"type": at_least(1), "default": 4, "help": "sequences per (length, depth)"}})
