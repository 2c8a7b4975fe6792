"""Text as token ids: UTF-8 bytes (ByteCodec) or a checkpoint's tokenizer (TokenizerCodec), and
which of them a model's needle text, corpus or chat data is encoded with (make_codec, codec_for).
Read by oomb tokenize and oomb corpus, by training's needles and by the retrieval evaluation."""
from __future__ import annotations

import numpy as np

from ..presets import PRESETS, load_tokenizer


class ByteCodec:
    """UTF-8 bytes as token ids (a byte-level vocabulary of 256); id 0 separates documents."""

    name = "bytes"
    eos = 0
    vocab_size = 256
    chat_template = None  # a chat needs --chat-template
    template_variables: dict = {}  # no special tokens for a template to name

    def __call__(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def array(self, text: str) -> np.ndarray:
        """The ids of a long text as one uint8 array (no per-byte Python objects)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, each id's first character index in text): a character's bytes all point at it."""
        ids = self.array(text)
        widths = [len(c.encode("utf-8")) for c in text] if len(ids) != len(text) else 1
        return ids, np.repeat(np.arange(len(text), dtype=np.int64), widths)


class TokenizerCodec:
    """A checkpoint's tokenizer, without special tokens; its EOS separates documents."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = getattr(tokenizer, "name_or_path", "tokenizer")
        self.eos = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.template_variables = dict(tokenizer.special_tokens_map)  # what apply_chat_template lets a template see

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, each id's first character index in text), as apply_chat_template tokenises a
        rendered chat (no special tokens added). Needs a fast tokenizer."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return (np.asarray(encoded["input_ids"], dtype=np.int64),
                np.array([s for s, _ in encoded["offset_mapping"]], dtype=np.int64).reshape(-1))

    def array(self, text: str) -> np.ndarray:
        return np.asarray(self(text), dtype=np.int64)


def make_codec(name: str, vocab_size: int | None = None, flag: str = "--tokenizer"):
    """'bytes' (a byte-level model) or a checkpoint directory / hub id with a tokenizer (also a
    corpus directory whose tokenizer oomb corpus --tokenizer bpe:N trained)."""
    if name == "bytes":
        if vocab_size is not None and vocab_size < 256:
            raise ValueError(f"a byte-level codec needs a vocabulary of >= 256 ids, the model has {vocab_size}")
        return ByteCodec()
    try:
        tokenizer = load_tokenizer(name)
    except ValueError as e:
        raise ValueError(f"no tokenizer for {flag} {name!r}: {e}; use 'bytes' for a byte-level model or a checkpoint "
                         "directory with tokenizer files") from None
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"{flag} {name!r} has {len(tokenizer):,} ids, more than the model's vocab_size="
                         f"{vocab_size:,}: it is not this model's tokenizer")
    return TokenizerCodec(tokenizer)


def codec_for(tokenizer: str, model: str, vocab_size: int):
    """What encodes needle text for this model: --tokenizer, else the checkpoint's own tokenizer,
    else bytes for a byte-level vocabulary (a preset, or a checkpoint trained on bytes)."""
    if tokenizer:
        return make_codec(tokenizer, vocab_size)
    if model not in PRESETS:
        try:
            return make_codec(model, vocab_size)
        except ValueError:
            if vocab_size != 256:
                raise
    if vocab_size != 256:
        raise ValueError(f"{model} has no tokenizer and a vocabulary of {vocab_size:,}, not bytes: pass --tokenizer "
                         "(a checkpoint directory with tokenizer files)")
    return make_codec("bytes", vocab_size)
