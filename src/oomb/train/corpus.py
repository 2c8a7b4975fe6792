"""A long-document corpus from text every machine with Python has: the source of installed packages.

One package is one document: its `.py` files in path order, each after a header line
`# ==== <path> ====`. Code has real long-range structure (a name defined in one file is used
thousands of lines later), which is what a long-context model must learn to use. Packages are
split into train and held-out by a hash of their name, so no held-out package was seen in
training, and the split is the same on every machine that has the package.

    oomb corpus --output data/code                       # byte-level (ids 0-255, 0 between documents)
    oomb corpus --output data/code --tokenizer /ckpt     # a checkpoint's tokenizer (its EOS between)
    oomb corpus --output data/code --tokenizer bpe:8192  # a BPE trained on the training split, saved beside

writes `train.npy`, `heldout.npy` (token files for --data / --eval-data) and `corpus.json`
(packages, sizes, split, settings); with bpe:VOCAB also the tokenizer (tokenizer.json and
tokenizer_config.json: `--tokenizer data/code` or `--model data/code` loads it later, offline).
"""
from __future__ import annotations

import hashlib
import json
import site
import sysconfig
from pathlib import Path

import numpy as np

from ..data.codec import TokenizerCodec, make_codec
from .outputs import make_folder

HEADER = "# ==== {path} ====\n"
SKIP_DIRS = {"__pycache__", "tests", "test"}


def site_roots() -> list[Path]:
    """The directories installed packages live in (site-packages), existing ones, no duplicates."""
    found = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    roots = []
    for r in found:
        p = Path(r).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def packages(roots: list[Path]) -> dict[str, tuple[Path, list[Path]]]:
    """Package name -> (its directory, its .py files in path order; tests and caches left out),
    for every top-level package directory of `roots` (the first root that has a name wins)."""
    found: dict[str, tuple[Path, list[Path]]] = {}
    for root in roots:
        for entry in sorted(Path(root).iterdir()):
            name = entry.name
            if not entry.is_dir() or not name.isidentifier() or name in found:
                continue
            files = sorted(p for p in entry.rglob("*.py")
                           if p.is_file() and not SKIP_DIRS & set(p.relative_to(entry).parts[:-1]))
            if files:
                found[name] = (entry, files)
    return found


def document(files: list[Path], package_dir: Path) -> str:
    """A package's text: each file after its path header (relative to the package's parent)."""
    return "".join(HEADER.format(path=f.relative_to(package_dir.parent).as_posix())
                   + f.read_text(encoding="utf-8", errors="replace").rstrip("\n") + "\n" for f in files)


def is_heldout(name: str, fraction: float) -> bool:
    """A fixed share of package names, by hash (the same split on every machine)."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return h % 10_000 < fraction * 10_000


def build_corpus(output: str | Path, roots: list[str | Path] | None = None, tokenizer: str = "bytes",
                 heldout: float = 0.1, max_bytes: int | None = None, min_bytes: int = 0) -> dict:
    """Write the corpus under `output`; returns its summary (also written as corpus.json).

    max_bytes: stop adding training packages past this much text (packages in hash order, so a
    cap keeps a spread of them); held-out packages are capped at a tenth of it. min_bytes: leave
    out packages smaller than this (short documents have little long-range structure)."""
    if not 0 < heldout < 1:
        raise ValueError(f"--heldout {heldout} must be a fraction between 0 and 1")
    roots = [Path(r) for r in roots] if roots else site_roots()
    missing = [str(r) for r in roots if not r.is_dir()]
    if missing:
        raise ValueError(f"--roots {missing[0]!r} is not a directory")
    bpe_vocab = parse_bpe(tokenizer)
    out = make_folder(output, f"--output {output}")  # before the packages are read and tokenised
    codec = None if bpe_vocab else make_codec(tokenizer)
    found = packages(roots)
    if not found:
        raise ValueError(f"no Python packages under {', '.join(map(str, roots))}")
    order = sorted(found, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    texts: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}  # (package, its text)
    size = {"train": 0, "heldout": 0}
    caps = {"train": max_bytes, "heldout": None if max_bytes is None else max(1, max_bytes // 10)}
    for name in order:
        split = "heldout" if is_heldout(name, heldout) else "train"
        if caps[split] is not None and size[split] >= caps[split]:
            continue
        text = document(found[name][1], found[name][0])
        text_bytes = len(text.encode("utf-8"))
        if text_bytes < min_bytes:
            continue
        texts[split].append((name, text))
        size[split] += text_bytes
    if not texts["train"] or not texts["heldout"]:
        raise ValueError(f"{len(found)} packages gave {len(texts['train'])} training and {len(texts['heldout'])} "
                         "held-out documents; both are needed: add --roots or change --heldout")
    if bpe_vocab:  # learnt from the training split only: the held-out text stays unseen
        codec = TokenizerCodec(train_bpe([t for _, t in texts["train"]], bpe_vocab, out))
    splits: dict[str, list[np.ndarray]] = {"train": [], "heldout": []}
    listed: dict[str, list[dict]] = {"train": [], "heldout": []}
    for split, docs in texts.items():
        for name, text in docs:
            ids = codec.array(text)
            if codec.eos is not None:
                ids = np.append(ids, np.asarray(codec.eos, dtype=ids.dtype))
            splits[split].append(ids)
            listed[split].append({"package": name, "files": len(found[name][1]), "tokens": len(ids)})
    top = max(int(a.max()) for part in splits.values() for a in part)
    dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32
    summary = {"tokenizer": tokenizer if bpe_vocab else codec.name, "separator": codec.eos, "heldout_fraction": heldout,
               "roots": [str(r) for r in roots], "max_bytes": max_bytes, "min_bytes": min_bytes}
    for split, arrays in splits.items():
        tokens = np.concatenate(arrays).astype(dtype)
        tmp = out / f"{split}.tmp.npy"  # whole or absent
        np.save(tmp, tokens)
        tmp.replace(out / f"{split}.npy")
        summary[split] = {"tokens": int(len(tokens)), "documents": len(arrays), "packages": listed[split]}
    (out / "corpus.json").write_text(json.dumps(summary, indent=1))
    return summary


EOS = "<|endoftext|>"  # id 0 of a trained BPE: it ends each document, as byte 0 does byte-level


def parse_bpe(tokenizer: str) -> int:
    """bpe:VOCAB -> VOCAB (0 for any other --tokenizer)."""
    if not tokenizer.startswith("bpe:"):
        return 0
    vocab = tokenizer[4:]
    if not vocab.isdigit() or not 258 <= int(vocab) <= 2**20:
        raise ValueError(f"--tokenizer {tokenizer!r}: bpe:VOCAB takes a vocabulary size from 258 (the 256 bytes, "
                         f"{EOS} and one merge) to {2**20:,}, e.g. bpe:8192")
    return int(vocab)


def train_bpe(texts: list[str], vocab_size: int, folder: Path):
    """A byte-level BPE (GPT-2's pre-tokenisation: every byte is a token, merges learnt from the
    texts; id 0 the EOS), trained with the tokenizers library and saved in
    `folder` (tokenizer.json, tokenizer_config.json) for AutoTokenizer; returned as a
    transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS)
    tokenizer.save_pretrained(folder)
    return tokenizer
