"""`oomb tokenize`: data files or hub datasets to a document file (data/documents.py).

Inputs: `.txt` (the whole file one document), `.jsonl` (a record per line), `.json` (a list of
records), `.parquet` (pyarrow), a directory written by `datasets`' save_to_disk, or anything
else `datasets.load_dataset` loads (a hub id org/name, a local folder of data files), one
--split of it, streamed with --streaming. A record is one of:

- text (continued pre-training): the codec's ids, then its EOS; every token trained.
- chat messages (a list of {role, content}, with the record's `tools` passed to the template):
  rendered with the chat template; only the assistant turns' tokens trained (train/chat.py).
- prompt and completion: strings (the completion's tokens and an EOS trained), or lists of
  messages (the whole conversation rendered; only the completion's assistant turns trained).

The codec is a tokenizer or `bytes` (UTF-8 bytes as ids, 0 ending each document: what oomb
corpus and eval use for byte-level models). With --num-proc N, N processes render and tokenise
the records (in order) while this one reads them.
"""
from __future__ import annotations

import json
import multiprocessing
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..data.codec import ByteCodec, make_codec
from ..data.documents import sibling, write_documents
from .chat import ChatRenderer, check_messages, check_tools
from .outputs import make_folder

FORMATS = (".txt, .jsonl, .json, .parquet, a directory written by datasets' save_to_disk, or a dataset "
           "datasets.load_dataset loads (a hub id org/name, a folder of data files)")
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Fields:
    """The record fields that hold each kind of data."""
    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    tools: str = "tools"

    def names(self) -> tuple[str, ...]:
        return (self.text, self.messages, self.prompt, self.completion, self.tools)


@dataclass(frozen=True)
class Hub:
    """How a dataset is loaded through datasets.load_dataset (hub ids, folders of data files)."""
    split: str | None = None  # None: 'train'; a save_to_disk DatasetDict needs one
    subset: str | None = None  # the dataset's configuration name
    streaming: bool = False
    num_proc: int = 1  # processes preparing a downloaded dataset (and tokenising: tokenize())


def read_records(path: str, fields: tuple[str, ...], hub: Hub = Hub()) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a data file; `where` names the file and the record
    ('a.jsonl:3', 'a.json[2]', 'a.parquet row 5'). A .txt file is one record {fields[0]: text};
    a columnar source reads only the columns among `fields` (all of them when it has none)."""
    p = Path(path)
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        yield from _saved_records(p, fields, hub)
    elif p.is_dir() or not p.exists() and p.suffix not in FILE_SUFFIXES:
        yield from _loaded_records(path, fields, hub)
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
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not a record (a JSON object with a text, "
                         "messages or prompt/completion field)")
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


def _datasets(path: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"input {path!r} is a directory or dataset name: reading it needs the datasets package: "
                         "pip install datasets (or pip install 'oomb[data]')") from None
    return datasets


def _rows(ds, name: str, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    columns = [c for c in fields if c in (ds.column_names or ())]  # a stream may not know its columns
    for row, record in enumerate(ds.select_columns(columns) if columns else ds):
        yield f"{name} row {row}", record


def _saved_records(path: Path, fields: tuple[str, ...], hub: Hub) -> Iterator[tuple[str, dict]]:
    datasets = _datasets(str(path))
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if hub.split is None or hub.split not in ds:
            given = f"--split {hub.split!r} is not one of them" if hub.split else "choose one with --split"
            raise ValueError(f"{path} holds the splits {', '.join(ds)}; {given} (e.g. --split {next(iter(ds))})")
        ds = ds[hub.split]
    yield from _rows(ds, str(path), fields)


def _loaded_records(name: str, fields: tuple[str, ...], hub: Hub) -> Iterator[tuple[str, dict]]:
    datasets = _datasets(name)
    split = hub.split or "train"
    try:
        ds = datasets.load_dataset(name, hub.subset, split=split, streaming=hub.streaming,
                                   num_proc=None if hub.streaming or hub.num_proc < 2 else hub.num_proc)
    except Exception as e:  # datasets raises many kinds (not found, no such split, offline, bad files)
        raise ValueError(f"input {name!r} is neither a local file nor a dataset datasets.load_dataset can load "
                         f"(split {split!r}{f', subset {hub.subset!r}' if hub.subset else ''}): {type(e).__name__}: "
                         f"{str(e)[:300]}; give a file oomb tokenize reads ({', '.join(FILE_SUFFIXES)}), a folder "
                         "of data files, or a hub id org/name with its --split (and --subset)") from None
    yield from _rows(ds, f"{name}[{split}]", fields)


class RecordEncoder:
    """(ids, mask or None, kind) of one record, kind one of 'text', 'chat', 'completion'. The chat
    template is checked at the first record that needs it."""

    def __init__(self, model: str, template: str | None, fields: Fields) -> None:
        self.model, self.template, self.fields = model, template, fields
        self.codec = make_codec(model, flag="--model")
        self.dtype = np.uint8 if isinstance(self.codec, ByteCodec) else np.uint16 if self.codec.vocab_size <= 2**16 \
            else np.uint32  # bytes as oomb corpus writes them
        self._chats = None

    @property
    def chats(self) -> ChatRenderer:
        if self._chats is None:
            self._chats = ChatRenderer(self.codec, self.template, self.model)
        return self._chats

    def __call__(self, where: str, record: dict) -> tuple[np.ndarray, np.ndarray | None, str]:
        f = self.fields
        tools = check_tools(record.get(f.tools), where)
        if record.get(f.messages) is not None:
            ids, mask = self.chats(check_messages(record[f.messages], where, f.messages), where, tools)
            return ids.astype(self.dtype), mask, "chat"
        if record.get(f.prompt) is not None or record.get(f.completion) is not None:
            ids, mask = self.completion(record.get(f.prompt), record.get(f.completion), where, tools)
            return ids.astype(self.dtype), mask, "completion"
        if record.get(f.text) is not None:  # columnar sources hold nulls for missing fields
            text = record[f.text]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {f.text!r} is a {type(text).__name__}, not a string")
            return self.with_eos(np.asarray(self.codec(text), dtype=self.dtype)), None, "text"
        present = ", ".join(k for k, v in record.items() if v is not None) or "none"
        raise ValueError(f"{where} has no {f.text!r} field; set --text-field (text) or --messages-field (chat), or "
                         f"give {f.prompt!r} and {f.completion!r} (its fields with a value: {present})")

    def with_eos(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.codec.eos is None else np.append(ids, np.asarray(self.codec.eos, dtype=ids.dtype))

    def completion(self, prompt, completion, where: str, tools) -> tuple[np.ndarray, np.ndarray]:
        """A prompt/completion pair: strings (the completion's tokens and an EOS trained; a token
        is the completion's when its first character is), or lists of messages."""
        f = self.fields
        if prompt is None or completion is None:
            missing = f.prompt if prompt is None else f.completion
            raise ValueError(f"{where} has {f.completion if prompt is None else f.prompt!r} but no {missing!r}: a "
                             "prompt/completion record needs both")
        if isinstance(prompt, str) and isinstance(completion, str):
            ids, first = self.codec.with_offsets(prompt + completion)
            mask = first >= len(prompt)
            if self.codec.eos is not None:
                ids, mask = self.with_eos(ids), np.append(mask, True)
            return ids, mask
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt = check_messages(prompt, where, f.prompt, assistant=False)
            completion = check_messages(completion, where, f.completion)
            return self.chats(prompt + completion, where, tools, prompt=prompt)
        raise ValueError(f"{where}: {f.prompt!r} and {f.completion!r} must both be strings or both lists of "
                         f"{{role, content}} turns, got a {type(prompt).__name__} and a {type(completion).__name__}")


_WORKER: RecordEncoder | None = None  # one per tokenising process


def _start_worker(*args) -> None:
    global _WORKER
    _WORKER = RecordEncoder(*args)


def _encode_in_worker(item: tuple[str, dict]):
    return _WORKER(*item)


def _all_records(inputs: list[str], fields: Fields, hub: Hub) -> Iterator[tuple[str, dict]]:
    for path in inputs:
        records = 0
        for item in read_records(path, fields.names(), hub):
            records += 1
            yield item
        if not records:
            raise ValueError(f"{path} holds no records (an empty file?); remove it from the inputs")


def encoded(encoder: RecordEncoder, records: Iterator, num_proc: int) -> Iterator:
    """encoder(where, record) of each record, in order: here, or in num_proc spawned processes
    (each loads the tokenizer once; a record's error is raised here, at its place)."""
    if num_proc < 2:
        yield from (encoder(*item) for item in records)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process whose tokenizer runs threads
    with context.Pool(num_proc, _start_worker, (encoder.model, encoder.template, encoder.fields)) as pool:
        yield from pool.imap(_encode_in_worker, records, chunksize=16)


def tokenize(model: str, inputs: list[str], output: str, text_field: str = "text", messages_field: str = "messages",
             chat_template: str | None = None, hub: Hub = Hub(), progress: bool = False) -> dict:
    """Tokenise `inputs` with `model`'s tokenizer ('bytes': UTF-8 bytes) into the document file
    `output` (.npy ids: uint8 for bytes, uint16 when the vocabulary fits, else uint32; .docs.npy;
    .mask.npy when any record is a chat or prompt/completion). `chat_template`: Jinja text that
    replaces the tokenizer's. `progress`: a tqdm bar of records on stderr (on a terminal).
    Returns counts: tokens, documents, chats, completions, trained (tokens), files."""
    from tqdm import tqdm

    if not output.endswith(".npy"):
        raise ValueError(f"--output {output!r}: token files are written as .npy (their dtype travels with them)")
    if hub.num_proc < 1:
        raise ValueError(f"--num-proc {hub.num_proc}: give 1 (tokenise here) or more processes")
    make_folder(Path(output).parent, f"--output {output}")  # before the tokenising, not after it
    fields = Fields(text=text_field, messages=messages_field)
    encoder = RecordEncoder(model, chat_template, fields)
    pieces, masks, kinds = [], [], {"text": 0, "chat": 0, "completion": 0}
    results = encoded(encoder, _all_records(inputs, fields, hub), hub.num_proc)
    for ids, mask, kind in tqdm(results, desc="tokenize", unit=" records", disable=None if progress else True,
                                file=sys.stderr, dynamic_ncols=True):
        kinds[kind] += 1
        if len(ids):
            pieces.append(ids)
            masks.append(mask)
    if not pieces:
        raise ValueError(f"{', '.join(inputs)}: every record is empty; there are no tokens to write")
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mask = None
    if kinds["chat"] or kinds["completion"]:  # text documents among them: every token trained
        mask = np.concatenate([np.ones(len(p), dtype=bool) if m is None else m for p, m in zip(pieces, masks)])
    write_documents(output, np.concatenate(pieces), starts, mask)
    total = int(lengths.sum())
    return {"tokens": total, "documents": len(pieces), "chats": kinds["chat"], "completions": kinds["completion"],
            "trained": total if mask is None else int(mask.sum()), "files": [output, str(sibling(output, "docs"))]
            + ([str(sibling(output, "mask"))] if mask is not None else [])}
