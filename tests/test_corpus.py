"""The corpus builder (train/corpus.py) on a small fake package tree, and the needle mixture."""
import json

import numpy as np
import pytest
import torch

from oomb.cli import main
from oomb.data.codec import ByteCodec
from oomb.data.tokens import copy_task
from oomb.train.corpus import build_corpus, is_heldout
from oomb.train.data import NeedleMix

FILES = {
    "alpha/__init__.py": "from .core import run\n",
    "alpha/core.py": "def run():\n    return 1\n",
    "alpha/sub/deep.py": "X = 2\n",
    "alpha/tests/test_core.py": "assert True\n",  # tests are left out
    "alpha/__pycache__/core.cpython-311.py": "junk\n",
    "beta/mod.py": "print('beta')\n",
    "gamma.dist-info/RECORD.py": "not a package\n",
    "single_module.py": "top-level modules are not packages\n",
}


def fake_tree(root, extra=20):
    for path, text in FILES.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for i in range(extra):  # enough packages for both splits
        (root / f"pkg{i}").mkdir()
        (root / f"pkg{i}" / "__init__.py").write_text(f"VALUE_{i} = {i}\n")


def test_corpus_of_a_fake_package_tree(tmp_path):
    fake_tree(tmp_path / "site")
    summary = build_corpus(tmp_path / "out", roots=[tmp_path / "site"], heldout=0.3)
    train, held = np.load(tmp_path / "out" / "train.npy"), np.load(tmp_path / "out" / "heldout.npy")
    assert train.dtype == np.uint8 and held.dtype == np.uint8
    docs = {}
    for part in (train, held):
        for doc in bytes(part).split(b"\x00")[:-1]:  # byte 0 ends every document
            name = doc.split(b"/", 1)[0].removeprefix(b"# ==== ").decode()
            docs[name] = doc.decode()
    assert set(docs) == {"alpha", "beta"} | {f"pkg{i}" for i in range(20)}
    assert docs["alpha"] == ("# ==== alpha/__init__.py ====\nfrom .core import run\n"
                             "# ==== alpha/core.py ====\ndef run():\n    return 1\n"
                             "# ==== alpha/sub/deep.py ====\nX = 2\n")  # path order, tests and caches left out
    held_names = {p["package"] for p in summary["heldout"]["packages"]}
    train_names = {p["package"] for p in summary["train"]["packages"]}
    assert held_names == {n for n in docs if is_heldout(n, 0.3)} and not held_names & train_names
    assert summary["train"]["tokens"] == len(train) and summary["heldout"]["tokens"] == len(held)
    written = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert written["train"]["documents"] == len(train_names) and written["tokenizer"] == "bytes"
    capped = build_corpus(tmp_path / "capped", roots=[tmp_path / "site"], heldout=0.3, max_bytes=60)
    assert capped["train"]["documents"] < len(train_names)  # stops adding packages past the cap
    main(["corpus", "--output", str(tmp_path / "cli"), "--roots", str(tmp_path / "site"), "--heldout", "0.3"])
    assert np.array_equal(np.load(tmp_path / "cli" / "train.npy"), train)  # the same split and order


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        build_corpus(tmp_path / "out", roots=[tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Python packages under"):
        build_corpus(tmp_path / "out", roots=[tmp_path / "empty"])
    with pytest.raises(ValueError, match="--heldout 1.5 must be a fraction"):
        build_corpus(tmp_path / "out", heldout=1.5)


def test_needle_mixture_is_deterministic_and_hides_queried_needles():
    mix = NeedleMix(ByteCodec(), "\nkey {key} is {value}.\n", rate=0.5, per_sequence=3)
    stream = mix.mix(copy_task(256, 2048, 4, seed=1), seed=1)
    again = NeedleMix(ByteCodec(), "\nkey {key} is {value}.\n", rate=0.5, per_sequence=3).mix(
        copy_task(256, 2048, 4, seed=1), seed=1)
    batches = [next(stream) for _ in range(4)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, [next(again) for _ in range(4)]))
    plain = copy_task(256, 2048, 4, seed=1)
    carriers = 0
    for (ids, labels), (orig, _) in zip(batches, [next(plain) for _ in range(4)]):
        assert ids is labels and ids.shape == (4, 2048)
        for row, o in zip(ids, orig):
            if torch.equal(row, o):
                continue
            carriers += 1
            text = bytes(row.numpy().astype(np.uint8)).decode("latin-1")
            needles = [line for line in text.split("\n") if line.startswith("key ")]
            # each needle appears twice: hidden in the text ("key K is V."), and as its query with the
            # answer at the end (the template up to and with the value: "key K is V")
            assert len(needles) == 6 and len({n.rstrip(".") for n in needles}) == 3
            assert sum(n.endswith(".") for n in needles) == 3 and text[-1].isdigit()
    assert 4 <= carriers <= 12  # about half of 16 sequences
    with pytest.raises(ValueError, match="needle_rate=0 must be in"):
        NeedleMix(ByteCodec(), "{key}{value}", rate=0)


def test_corpus_with_a_bpe_trained_on_it(tmp_path, capsys):
    """--tokenizer bpe:300: a byte-level BPE learnt from the training split, saved beside the token
    files; its ids decode back to the documents, and the folder serves as a tokenizer later
    (oomb tokenize --model DIR, needles' --tokenizer DIR)."""
    from transformers import AutoTokenizer

    from oomb.data.codec import make_codec

    fake_tree(tmp_path / "site")
    out = tmp_path / "out"
    main(["corpus", "--output", str(out), "--roots", str(tmp_path / "site"), "--heldout", "0.3",
          "--tokenizer", "bpe:300"])
    tok = AutoTokenizer.from_pretrained(out)
    assert 257 < len(tok) <= 300 and tok.eos_token_id == 0 and (out / "tokenizer.json").is_file()  # few merges here
    summary = json.loads((out / "corpus.json").read_text())
    assert summary["tokenizer"] == "bpe:300" and summary["separator"] == 0
    plain = build_corpus(tmp_path / "bytes", roots=[tmp_path / "site"], heldout=0.3)
    for split in ("train", "heldout"):
        ids = np.load(out / f"{split}.npy")
        assert ids.dtype == np.uint16 and ids.max() < 300 and ids[-1] == 0
        docs = np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]
        texts = [tok.decode(d[:-1].tolist()) for d in docs]
        assert "".join(texts).encode() == bytes(np.load(tmp_path / "bytes" / f"{split}.npy")).replace(b"\x00", b"")
        assert len(ids) < plain[split]["tokens"]  # merges were learnt
    assert make_codec(str(out))("def run():") == tok("def run():", add_special_tokens=False)["input_ids"]
    (tmp_path / "t.jsonl").write_text('{"text": "def run():"}\n')
    main(["tokenize", str(tmp_path / "t.jsonl"), "--model", str(out), "--output", str(tmp_path / "t.npy")])
    assert np.load(tmp_path / "t.npy").tolist() == tok("def run():", add_special_tokens=False)["input_ids"] + [0]
    with pytest.raises(ValueError, match="bpe:VOCAB takes a vocabulary size from 258"):
        build_corpus(tmp_path / "x", roots=[tmp_path / "site"], tokenizer="bpe:100")
