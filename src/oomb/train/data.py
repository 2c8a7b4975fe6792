"""Training batches: endless streams of the built-in copy task, random windows of a token file,
or a document file's sequences (oomb.data.documents, written by `oomb tokenize`: train/sources.py),
with key-value needles (NeedleMix) or recall pairs (oomb.data.recall) in them. The files and
the copy task are read by oomb.data.tokens, which evaluation reads too.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ..data.documents import data_layout, document_batches, open_documents
from ..data.needles import check_template, make_needle, with_needles
from ..data.recall import RecallMix
from ..data.tokens import copy_task, load_tokens


def token_file(data: np.ndarray, seq_len: int, batch: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of seq_len tokens of a 1-D token array (longer than seq_len)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len, size=batch)
        ids = torch.from_numpy(np.stack([data[s : s + seq_len].astype(np.int64) for s in starts]))
        yield ids, ids


def make_data(source: str, vocab_size: int, seq_len: int, batch: int, seed: int = 0, dtype: str = "uint16",
              needles=None, pack: bool | None = None, drop_long: bool = False):
    """Endless training batches of `source`: 'copy', a token file (random windows), or a document
    file (oomb.data.documents: `pack`ed, or one document per sequence; pack=None packs chat data
    and takes windows of text). (input_ids, labels), packed (input_ids, labels, position_ids).
    `needles` (NeedleMix) puts key-value needles into a share of the windows."""
    how = data_layout(source, pack)
    if how != "windows":
        if needles is not None:
            raise ValueError(f"needles go into windows of a token stream; {source} is trained as documents "
                             f"({how}): drop --needle-rate, or train on its windows (leave out --pack/--no-pack)")
        return document_batches(open_documents(source, vocab_size), seq_len, batch, seed, how == "packed", drop_long)
    if source == "copy":
        stream = copy_task(vocab_size, seq_len, batch, seed)
    else:
        tokens = load_tokens(source, vocab_size, seq_len, dtype)
        if isinstance(needles, RecallMix):
            needles.task.check_text(tokens, vocab_size, source)
        stream = token_file(tokens, seq_len, batch, seed)
    return stream if needles is None else needles.mix(stream, seed)


class NeedleMix:
    """A share `rate` of the sequences carry `per_sequence` key-value needles at random depths and
    their queries at the end (oomb.data.needles), so that retrieval over the whole context is
    learnable from scratch; the others are left as they are."""

    def __init__(self, codec, template: str, rate: float, per_sequence: int = 4) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"needle_rate={rate} must be in (0, 1]")
        if per_sequence < 1:
            raise ValueError(f"needles per sequence={per_sequence} must be >= 1")
        check_template(template)
        self.codec, self.template, self.rate, self.per_sequence = codec, template, rate, per_sequence

    def mix(self, stream, seed: int):
        rng = np.random.default_rng([seed, 7_741])
        for ids, labels in stream:
            ids = ids.clone()
            for b in range(ids.shape[0]):
                if rng.random() >= self.rate:
                    continue
                needles = [make_needle(self.codec, self.template, rng) for _ in range(self.per_sequence)]
                row, _ = with_needles(ids[b].numpy(), needles, list(rng.random(self.per_sequence)), ids.shape[1])
                ids[b] = torch.from_numpy(row)
            yield ids, ids
