"""`oomb tokenize`: local data files to a document file (train/documents.py).

Inputs: `.txt` (the whole file one document), `.jsonl` (a record per line), `.json` (a list of
records), `.parquet` (pyarrow) or a directory written by `datasets`' save_to_disk (the datasets
package). A record holds text (continued pre-training: the tokenizer's ids, then its EOS; every
token trained) or chat messages (a list of {role, content}, rendered with the tokenizer's chat
template; only the assistant turns' tokens trained: train/chat.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from .. import presets
from .chat import render_chat
from .documents import sibling, write_documents
from .outputs import make_folder

FORMATS = ".txt, .jsonl, .json, .parquet or a directory written by datasets' save_to_disk"


def read_records(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a data file; `where` names the file and the record
    ('a.jsonl:3', 'a.json[2]', 'a.parquet row 5'). A .txt file is one record {fields[0]: text};
    a columnar source reads only the columns among `fields` (all of them when it has none)."""
    p = Path(path)
    if p.is_dir():
        yield from _dataset_records(p, fields)
    elif not p.is_file():
        raise ValueError(f"input {path!r}: no such file or directory")
    elif p.suffix == ".txt":
        text = p.read_text(encoding="utf-8")
        if text:
            yield path, {fields[0]: text}
    elif p.suffix == ".jsonl":
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{n}", _record(_json(line, f"{path}:{n}", "a .jsonl file holds a JSON object per "
                                                                           "line"), f"{path}:{n}")
    elif p.suffix == ".json":
        records = _json(p.read_text(encoding="utf-8"), path, "a .json file holds a list of records")
        if not isinstance(records, list):
            raise ValueError(f"{path} holds a JSON {type(records).__name__}, not a list of records; a .json file "
                             "holds a list of JSON objects (one object per line is .jsonl)")
        for i, record in enumerate(records):
            yield f"{path}[{i}]", _record(record, f"{path}[{i}]")
    elif p.suffix == ".parquet":
        yield from _parquet_records(p, fields)
    else:
        raise ValueError(f"input {path!r}: unknown extension {p.suffix!r}; oomb tokenize reads {FORMATS}")


def _json(text: str, where: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); {what}") from None


def _record(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not a record (a JSON object with a text or "
                         "messages field)")
    return record


def _parquet_records(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading .parquet files needs pyarrow: pip install pyarrow "
                         "(or pip install 'oomb[data]')") from None
    f = pq.ParquetFile(path)
    columns = [c for c in fields if c in f.schema_arrow.names] or None
    row = 0
    for batch in f.iter_batches(batch_size=1024, columns=columns):
        for record in batch.to_pylist():
            yield f"{path} row {row}", record
            row += 1


def _dataset_records(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"input {str(path)!r} is a directory: reading a dataset saved with save_to_disk needs the "
                         "datasets package: pip install datasets (or pip install 'oomb[data]')") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"input {str(path)!r} is a directory but not a dataset written by save_to_disk ({e}); "
                         f"oomb tokenize reads {FORMATS}") from None
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"{path} holds the splits {', '.join(ds)}; pass one split's directory, e.g. "
                         f"{path / next(iter(ds))}")
    columns = [c for c in fields if c in ds.column_names]
    for row, record in enumerate(ds.select_columns(columns) if columns else ds):
        yield f"{path} row {row}", record


def load_tokenizer(model: str):
    try:
        return presets.load_tokenizer(model)
    except ValueError as e:
        raise ValueError(f"no tokenizer for --model {model!r}: {e}; a local checkpoint directory or hub id with "
                         "tokenizer files is needed") from None


def tokenize(model: str, inputs: list[str], output: str, text_field: str = "text",
             messages_field: str = "messages") -> dict:
    """Tokenise `inputs` with `model`'s tokenizer into the document file `output` (.npy ids,
    uint16 when the vocabulary fits, else uint32; .docs.npy; .mask.npy when any record is a
    chat). Returns counts: tokens, documents, chats, trained (tokens)."""
    if not output.endswith(".npy"):
        raise ValueError(f"--output {output!r}: token files are written as .npy (their dtype travels with them)")
    make_folder(Path(output).parent, f"--output {output}")  # before the tokenising, not after it
    tok = load_tokenizer(model)
    dtype = np.uint16 if len(tok) <= 2**16 else np.uint32
    pieces, masks, chats = [], [], 0
    for path in inputs:
        records = 0
        for where, record in read_records(path, (text_field, messages_field)):
            records += 1
            if record.get(messages_field) is not None:
                if not chats:
                    check_chat_tokenizer(tok, model)
                ids, mask = render_chat(tok, record[messages_field], where)
                chats += 1
            elif record.get(text_field) is not None:  # columnar sources hold nulls for missing fields
                text = record[text_field]
                if not isinstance(text, str):
                    raise ValueError(f"{where}: field {text_field!r} is a {type(text).__name__}, not a string")
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if tok.eos_token_id is not None:
                    ids.append(tok.eos_token_id)
                mask = None
            else:
                fields = ", ".join(k for k, v in record.items() if v is not None) or "none"
                raise ValueError(f"{where} has no {text_field!r} field; set --text-field (text) or --messages-field "
                                 f"(chat) to the field that holds it (its fields with a value: {fields})")
            if len(ids):
                pieces.append(np.asarray(ids, dtype=dtype))
                masks.append(mask)
        if not records:
            raise ValueError(f"{path} holds no records (an empty file?); remove it from the inputs")
    if not pieces:
        raise ValueError(f"{', '.join(inputs)}: every record is empty; there are no tokens to write")
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mask = None
    if chats:  # text documents among chats: every token trained
        mask = np.concatenate([np.ones(len(p), dtype=bool) if m is None else m for p, m in zip(pieces, masks)])
    write_documents(output, np.concatenate(pieces), starts, mask)
    total = int(lengths.sum())
    return {"tokens": total, "documents": len(pieces), "chats": chats,
            "trained": total if mask is None else int(mask.sum()), "files": [output, str(sibling(output, "docs"))]
            + ([str(sibling(output, "mask"))] if chats else [])}


def check_chat_tokenizer(tok, model: str) -> None:
    """Chat records need a chat template, and a fast tokenizer to map characters to tokens."""
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer of --model {model!r} has no chat template, which chat ('messages') records "
                         "need; use an instruct checkpoint's tokenizer, or set chat_template in its "
                         "tokenizer_config.json")
    if not tok.is_fast:
        raise ValueError(f"the tokenizer of --model {model!r} is a slow (Python) one; locating the assistant's tokens "
                         "needs a fast one (tokenizer.json) for their character offsets")
