"""A long-document corpus from text every machine with Python has: the source of installed packages.

One package is one document: its `.py` files in path order, each after a header line
`# ==== <path> ====`. Code has real long-range structure (a name defined in one file is used
thousands of lines later), which is what a long-context model must learn to use. Packages are
split into train and held-out by a hash of their name, so no held-out package was seen in
training, and the split is the same on every machine that has the package.

    oomb corpus --output data/code                       # byte-level (ids 0-255, 0 between documents)
    oomb corpus --output data/code --tokenizer /ckpt     # a checkpoint's tokenizer (its EOS between)

writes `train.npy`, `heldout.npy` (token files for --data / --eval-data) and `corpus.json`
(packages, sizes, split, settings).
"""
from __future__ import annotations

import hashlib
import json
import site
import sysconfig
from pathlib import Path

import numpy as np

from .needles import make_codec
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
    out = make_folder(output, f"--output {output}")  # before the packages are read and tokenised
    codec = make_codec(tokenizer)
    found = packages(roots)
    if not found:
        raise ValueError(f"no Python packages under {', '.join(map(str, roots))}")
    order = sorted(found, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    splits: dict[str, list[np.ndarray]] = {"train": [], "heldout": []}
    listed: dict[str, list[dict]] = {"train": [], "heldout": []}
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
        ids = codec.array(text)
        if codec.eos is not None:
            ids = np.append(ids, np.asarray(codec.eos, dtype=ids.dtype))
        splits[split].append(ids)
        listed[split].append({"package": name, "files": len(found[name][1]), "tokens": len(ids)})
        size[split] += text_bytes
    if not splits["train"] or not splits["heldout"]:
        raise ValueError(f"{len(found)} packages gave {len(splits['train'])} training and {len(splits['heldout'])} "
                         "held-out documents; both are needed: add --roots or change --heldout")
    top = max(int(a.max()) for part in splits.values() for a in part)
    dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32
    summary = {"tokenizer": codec.name, "separator": codec.eos, "heldout_fraction": heldout,
               "roots": [str(r) for r in roots], "max_bytes": max_bytes, "min_bytes": min_bytes}
    for split, arrays in splits.items():
        tokens = np.concatenate(arrays).astype(dtype)
        tmp = out / f"{split}.tmp.npy"  # whole or absent
        np.save(tmp, tokens)
        tmp.replace(out / f"{split}.npy")
        summary[split] = {"tokens": int(len(tokens)), "documents": len(arrays), "packages": listed[split]}
    (out / "corpus.json").write_text(json.dumps(summary, indent=1))
    return summary
