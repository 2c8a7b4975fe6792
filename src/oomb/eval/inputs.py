"""The evaluated sequences that several tasks share (loss, position-loss, selection-recall, and any
task that reads --data as they do), and the flag that sizes them."""
from __future__ import annotations

import argparse
from collections.abc import Iterable
from itertools import islice

import torch

from ..flags import at_least

Batches = Iterable[tuple[torch.Tensor, ...]]  # (input_ids, labels) or packed (input_ids, labels, position_ids)

#: one flag for every task that evaluates eval_batches (registry: declared once, the same object)
BATCHES = {"type": at_least(1), "default": 4, "help": "evaluate calls (token files: windows / --batch)"}


def eval_batches(args: argparse.Namespace, vocab: int) -> list[tuple]:
    """A token file's first windows of seq_len (non-overlapping, the same every run), a document
    file's first packed sequences (each document attending to itself, position_ids restarting at
    its start; chat files score the assistant's tokens only), or `args.batches` generated batches
    of the copy task: (input_ids, labels) or (input_ids, labels, position_ids) each."""
    from ..data.documents import evaluation_batches, has_documents, open_documents
    from ..data.tokens import copy_task, load_tokens, windows

    if args.data == "copy":
        return list(islice(copy_task(vocab, args.seq_len, args.batch, seed=args.seed), args.batches))
    if has_documents(args.data):
        return list(evaluation_batches(open_documents(args.data, vocab), args.seq_len, args.batch,
                                       args.batches * args.batch))
    data = load_tokens(args.data, vocab, args.seq_len, args.data_dtype)
    return list(windows(data, args.seq_len, args.batch, args.batches * args.batch))
