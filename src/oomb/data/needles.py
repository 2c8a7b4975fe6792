"""Key-value needles: a line that binds a random key to a random value, hidden in long text, and
a query at the end that names the key; predicting the value needs the line, however far back.

One template serves both: `"...{key}...{value}..."`. The needle is the template filled in; the
query is the template's text up to `{value}`, and the value's tokens are the targets. Every
piece is encoded on its own (the text before the value, the value, the text after it), so the
needle and the query carry the value as the same tokens for a byte-level model and for a
tokenizer alike (oomb.data.codec encodes). Used by the retrieval evaluation (oomb.eval) and, as a
share of training sequences, by the training data (train/data.py), so retrieval is learnable from scratch.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Callable

import numpy as np

DEFAULT_TEMPLATE = "\nThe value of key {key} is {value}.\n"
KEY_ALPHABET = string.ascii_lowercase
VALUE_ALPHABET = string.digits


def check_template(template: str) -> tuple[str, str]:
    """(text before {value} with {key} in it, text after {value})."""
    if template.count("{value}") != 1 or "{key}" not in template.split("{value}")[0]:
        raise ValueError(f"--needle-template {template!r} must hold {{key}} and then exactly one {{value}}, "
                         f"e.g. {DEFAULT_TEMPLATE!r}")
    before, after = template.split("{value}")
    return before, after


@dataclass
class Needle:
    key: str
    value: str
    tokens: np.ndarray  # the needle: template filled in
    query: np.ndarray  # the text before the value, key filled in
    answer: np.ndarray  # the value's tokens: the targets after the query


def make_needle(codec: Callable[[str], list[int]], template: str, rng: np.random.Generator,
                key_len: int = 6, value_len: int = 6) -> Needle:
    before, after = check_template(template)
    key = "".join(rng.choice(list(KEY_ALPHABET), key_len))
    value = "".join(rng.choice(list(VALUE_ALPHABET), value_len))
    query = np.asarray(codec(before.replace("{key}", key)), dtype=np.int64)
    answer = np.asarray(codec(value), dtype=np.int64)
    tail = np.asarray(codec(after.replace("{key}", key)), dtype=np.int64)
    return Needle(key, value, np.concatenate([query, answer, tail]), query, answer)


def with_needles(haystack: np.ndarray, needles: list[Needle], depths: list[float],
                 length: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """`length` tokens: the haystack's start with each needle at its depth (0: the start, 1: just
    before the queries), then the queries with their answers, in the needles' order. Returns the
    tokens and each answer's [start, end) positions (the targets to score)."""
    queries = [np.concatenate([n.query, n.answer]) for n in needles]
    tail = sum(len(q) for q in queries)
    body = length - tail - sum(len(n.tokens) for n in needles)
    if body < 0:
        raise ValueError(f"length={length} is too short for {len(needles)} needles and their queries "
                         f"({length - body} tokens)")
    if len(haystack) < body:
        raise ValueError(f"the haystack holds {len(haystack):,} tokens, {body:,} are needed")
    text = haystack[:body].astype(np.int64)
    order = sorted(range(len(needles)), key=lambda j: depths[j])
    pieces, at = [], 0
    for j in order:
        cut = int(round(depths[j] * body))
        pieces += [text[at:cut], needles[j].tokens]
        at = cut
    pieces.append(text[at:])
    answers, pos = [], length - tail
    for q, n in zip(queries, needles):
        start = pos + len(n.query)
        answers.append((start, start + len(n.answer)))
        pos += len(q)
    out = np.concatenate(pieces + queries)
    assert len(out) == length
    return out, answers


def hits(predictions: np.ndarray, tokens: np.ndarray, answers: list[tuple[int, int]]) -> list[bool]:
    """Whether each answer was predicted whole: the argmax at every one of its positions (the
    prediction for token p, made from tokens < p) equals the token there (teacher-forced)."""
    return [bool(np.array_equal(predictions[s:e], tokens[s:e])) for s, e in answers]
