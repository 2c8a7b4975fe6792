"""oomb tokenize's data sources (text and chat records in .jsonl, .json, .parquet, datasets
directories) and the document files the trainer cuts into sequences, packed or one each (CPU,
seconds). Tokenizers are built here: nothing is downloaded."""
import json
import re
import sys
import warnings

import numpy as np
import pytest
import torch

from oomb.cli import main
from oomb.data.documents import (Documents, best_fit_decreasing, document_batches, open_documents, plan_sequences,
                                 sequence, sibling)
from oomb.loss import IGNORE_INDEX
from oomb.train.chat import render_chat
from oomb.train.data import make_data
from oomb.train.sources import tokenize

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "the", "cat", "sat", "on",
         "mat", "a", "dog", "hello", "how", "are", "you"]
ID = {w: i for i, w in enumerate(WORDS)}
CHAT = [{"role": "system", "content": "a dog"}, {"role": "user", "content": "hello cat"},
        {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "a dog sat on the mat"}]
SMALL = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "16", "--backend", "torch", "--device", "cpu",
         "--log-every", "10"]


def word_tokenizer(path, template=CHATML):
    """Whole words and ChatML's markers, one token each: the expected tokens can be written by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if template:
        tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("words"))


def records():
    return [{"text": "the cat sat on the mat"}, {"messages": CHAT},
            {"messages": [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "a dog"}]},
            {"text": "a dog"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read(out):
    mask = sibling(out, "mask")
    return np.load(out), np.load(sibling(out, "docs")), np.load(mask) if mask.exists() else None


def test_chat_labels_cover_exactly_the_assistant_tokens(ckpt):
    """Each assistant turn's text and end-of-turn marker, nothing else; the ids are
    apply_chat_template's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ids, mask = render_chat(tok, CHAT, "test")
    # written out by hand: the rendered conversation, token by token, * where trained
    expected = ("<|im_start|> system a dog <|im_end|> <|im_start|> user hello cat <|im_end|> "
                "<|im_start|> assistant the* cat* sat* <|im_end|>* <|im_start|> user how are you <|im_end|> "
                "<|im_start|> assistant a* dog* sat* on* the* mat* <|im_end|>*").split()
    assert ids == [ID[w.rstrip("*")] for w in expected]
    assert mask.tolist() == [w.endswith("*") for w in expected]
    assert ids == list(tok.apply_chat_template(CHAT)["input_ids"])
    # a template without a generation prompt: the assistant header is part of the turn
    tok.chat_template = CHATML.split("{% if add_generation_prompt %}")[0]
    ids, mask = render_chat(tok, CHAT[2:], "test")
    assert mask.tolist() == [w.endswith("*") for w in
                             "<|im_start|>* assistant* the* cat* sat* <|im_end|>* <|im_start|> user how are you "
                             "<|im_end|> <|im_start|>* assistant* a* dog* sat* on* the* mat* <|im_end|>*".split()]


def byte_bpe(path, template):
    """A byte-level BPE tokenizer (GPT-2 style: tokens straddle spaces and newlines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([" ".join(WORDS[4:])] * 20 + ["user\nassistant\n the cat, sat? on a mat!"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


def test_chat_labels_match_the_generation_marks_of_a_template_that_has_them(tmp_path):
    """On a template that marks the assistant's text with {% generation %}, the turns found by
    rendering prefixes are exactly transformers' assistant mask, for conversations of several
    turns with odd spacing and punctuation, tokenised byte-level."""
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
              "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\n' }}{% else %}<|im_start|>{{ m['role'] }}\n"
              "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = byte_bpe(tmp_path, marked)
    rng = np.random.default_rng(0)
    for n in range(8):
        turns = [{"role": ["user", "assistant"][i % 2],
                  "content": " ".join(rng.choice(WORDS[4:] + ["cat,", "sat?", " on", "mat!\n"], rng.integers(1, 9)))}
                 for i in range(2 + n % 5)]
        ids, mask = render_chat(tok, turns, f"conversation {n}")
        want = tok.apply_chat_template(turns, return_assistant_tokens_mask=True, return_dict=True)
        assert ids == list(want["input_ids"]) and mask.astype(int).tolist() == list(want["assistant_masks"]), n


def test_jsonl_text_and_chat_records(tmp_path, ckpt):
    """Text records: their ids and EOS, every token trained; chat records: the assistant's tokens."""
    out = str(tmp_path / "r.npy")
    n = tokenize(ckpt, [write_jsonl(tmp_path / "r.jsonl", records())], out)
    ids, starts, mask = read(out)
    text = [ID[w] for w in "the cat sat on the mat".split()] + [ID["<eos>"]]
    # 7 text tokens, the 31 of CHAT (11 trained), 11 of the short chat (3 trained), 3 text tokens
    assert ids[:7].tolist() == text and ids[-3:].tolist() == [ID["a"], ID["dog"], ID["<eos>"]]
    assert starts.tolist() == [0, 7, 38, 49] and len(ids) == 52 and ids.dtype == np.uint16
    assert mask[:7].all() and mask[7:38].sum() == 11 and mask[38:49].sum() == 3 and mask[49:].all()
    assert n == {"tokens": 52, "documents": 4, "chats": 2, "completions": 0, "trained": 24,
                 "files": [out, str(sibling(out, "docs")), str(sibling(out, "mask"))]}


def write_json(path, rows):
    path = path.with_suffix(".json")
    path.write_text(json.dumps(rows))
    return path


def columns(rows):
    """{field: values} with None where a record lacks the field (a columnar source's nulls)."""
    return {k: [r.get(k) for r in rows] for k in ("text", "messages")}


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install pyarrow")
    import pyarrow.parquet as pq

    path = path.with_suffix(".parquet")
    pq.write_table(pa.table(columns(rows)), path)
    return path


def write_dataset(path, rows):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed: pip install datasets")
    datasets.Dataset.from_dict(columns(rows)).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("write", [write_json, write_parquet, write_dataset], ids=["json", "parquet", "datasets"])
def test_every_format_reads_the_same_records(tmp_path, ckpt, write):
    """.json, .parquet and a datasets directory give the document file .jsonl gives."""
    tokenize(ckpt, [write_jsonl(tmp_path / "r.jsonl", records())], str(tmp_path / "want.npy"))
    tokenize(ckpt, [str(write(tmp_path / "r", records()))], str(tmp_path / "got.npy"))
    for want, got in zip(read(str(tmp_path / "want.npy")), read(str(tmp_path / "got.npy"))):
        assert np.array_equal(want, got)


def test_text_only_files_have_no_mask_and_a_stale_one_is_removed(tmp_path, ckpt):
    out = str(tmp_path / "t.npy")
    tokenize(ckpt, [write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])], out)
    assert sibling(out, "mask").exists()
    (tmp_path / "a.txt").write_text("the cat sat")
    n = tokenize(ckpt, [str(tmp_path / "a.txt"), write_jsonl(tmp_path / "t.jsonl", [{"text": "a dog"}])], out)
    ids, starts, mask = read(out)
    assert mask is None and starts.tolist() == [0, 4] and n["tokens"] == len(ids) == 7 and n["chats"] == 0


def random_documents(rng, n, longest, masked=True, vocab=200):
    lengths = rng.integers(1, longest + 1, n)
    ids = rng.integers(1, vocab, int(lengths.sum())).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    mask = rng.random(len(ids)) < 0.7 if masked else None
    return Documents("docs.npy", ids, starts, lengths.astype(np.int64), mask)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.filterwarnings("ignore:docs.npy. 75 of 300 documents")  # counted once below
def test_sequences_are_whole_documents_without_cross_document_targets(pack):
    """Every kept document is in exactly one sequence, whole or cut to seq_len; position_ids
    restart at 0 at each document (and at the pads); no target crosses a document boundary; a
    document's labels are its ids where trained; the same plan and rows every time."""
    rng = np.random.default_rng(0)
    seq_len = 128
    docs = random_documents(rng, 300, 160)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_sequences(docs, seq_len, pack)
    assert plan == plan_sequences(docs, seq_len, pack)  # deterministic
    placed = sorted(d for s in plan for d in s)
    assert len(placed) == len(set(placed))
    cut = np.minimum(docs.lengths, seq_len)
    untrained = [d for d in range(300) if d not in placed]
    assert all(not docs.trained(d, int(cut[d])) for d in untrained)  # left out only when nothing is trained
    long = int((docs.lengths > seq_len).sum())
    assert len(caught) == 1 and f"{long:,} of 300 documents are longer than seq_len=128" in str(caught[0].message)
    assert f"{len(untrained)} documents have no trained token" in str(caught[0].message)
    for members in plan:
        assert cut[members].sum() <= seq_len and (pack or len(members) == 1)
        ids, labels, positions = sequence(docs, members, seq_len)
        at = 0
        for d in members:
            s, n = int(docs.starts[d]), int(cut[d])
            assert np.array_equal(ids[at : at + n], docs.ids[s : s + n])
            assert np.array_equal(positions[at : at + n], np.arange(n))
            want = np.where(docs.mask[s : s + n], docs.ids[s : s + n].astype(np.int64), IGNORE_INDEX)
            want[0] = IGNORE_INDEX
            assert np.array_equal(labels[at : at + n], want)
            at += n
        assert (ids[at:] == 0).all() and (labels[at:] == IGNORE_INDEX).all()
        assert np.array_equal(positions[at:], np.arange(seq_len - at))
        # position t predicts labels[t + 1]: only ever the next token of the same document
        targets = np.flatnonzero(labels[1:] != IGNORE_INDEX)
        assert (positions[targets + 1] == positions[targets] + 1).all()
    a = document_batches(docs, seq_len, 3, seed=5, pack=pack)
    b = document_batches(docs, seq_len, 3, seed=5, pack=pack)
    for _ in range(len(plan) // 3 + 2):  # past one pass over the sequences
        x, y = next(a), next(b)
        assert len(x) == (3 if pack else 2) and all(torch.equal(u, v) for u, v in zip(x, y))
        assert x[0].shape == (3, seq_len) and x[0].dtype == torch.int64


def test_best_fit_decreasing():
    """Longest first, each into the fullest sequence it fits; fills as well as the sizes allow."""
    assert best_fit_decreasing(np.array([6, 5, 4, 3, 2]), 10) == [[0, 2], [1, 3, 4]]
    assert best_fit_decreasing(np.array([10, 1, 10]), 10) == [[0], [2], [1]]
    lengths = np.random.default_rng(1).integers(1, 2048, 2000)
    plan = best_fit_decreasing(lengths, 4096)
    assert sorted(d for s in plan for d in s) == list(range(2000))
    assert all(lengths[s].sum() <= 4096 for s in plan)
    assert len(plan) <= 1.02 * lengths.sum() / 4096 + 1


def test_long_documents_are_cut_with_one_warning_or_dropped(tmp_path, ckpt):
    rows = [{"text": " ".join(["the cat"] * n)} for n in (2, 40, 3, 50, 1)]
    out = str(tmp_path / "long.npy")
    tokenize(ckpt, [write_jsonl(tmp_path / "long.jsonl", rows)], out)
    docs = open_documents(out, 256)
    with pytest.warns(UserWarning) as caught:
        plan = plan_sequences(docs, 64, pack=True)
    assert len(caught) == 1
    assert "2 of 5 documents are longer than seq_len=64 and are cut to their first 64 tokens" in str(caught[0].message)
    assert sorted(d for s in plan for d in s) == [0, 1, 2, 3, 4]
    with pytest.warns(UserWarning, match="2 of 5 documents are longer than seq_len=64 and are left out"):
        plan = plan_sequences(docs, 64, pack=False, drop_long=True)
    assert plan == [[0], [2], [4]]
    with pytest.raises(ValueError, match="no document is left to train on .5 of 5 documents are longer than seq_len=2"):
        plan_sequences(docs, 2, pack=True, drop_long=True)


def tokenize_error(tmp_path, ckpt, inputs, *flags, model=None):
    with pytest.raises(SystemExit) as e:
        main(["tokenize", *map(str, inputs), "--model", model or ckpt, "--output", str(tmp_path / "o.npy"), *flags])
    return str(e.value)


def test_bad_input_is_refused_with_the_record_and_the_fix(tmp_path, ckpt, monkeypatch):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a dog"}, {"body": "the cat"}])
    message = tokenize_error(tmp_path, ckpt, [bad])
    assert f"{bad}:2 has no 'text' field; set --text-field (text) or --messages-field (chat)" in message
    assert "(its fields with a value: body)" in message
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "empty.jsonl holds no records (an empty file?)" in tokenize_error(tmp_path, ckpt, [tmp_path / "empty.jsonl"])
    (tmp_path / "data.csv").write_text("text\nthe cat\n")
    assert "unknown extension '.csv'; oomb tokenize reads .txt, .jsonl, .json, .parquet, a directory" in \
        tokenize_error(tmp_path, ckpt, [tmp_path / "data.csv"])
    assert "no such file or directory" in tokenize_error(tmp_path, ckpt, [tmp_path / "missing.jsonl"])
    mute = write_jsonl(tmp_path / "mute.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    assert f"{mute}:2: the messages have no 'assistant' turn (roles: system, user)" in \
        tokenize_error(tmp_path, ckpt, [mute])
    turn = write_jsonl(tmp_path / "turn.jsonl", [{"messages": [{"content": "a dog"}]}])
    assert "messages[0] = \"{'content': 'a dog'}\" is not a {role, content} turn" in \
        tokenize_error(tmp_path, ckpt, [turn])
    (tmp_path / "obj.json").write_text('{"text": "a dog"}')
    assert "holds a JSON dict, not a list of records" in tokenize_error(tmp_path, ckpt, [tmp_path / "obj.json"])
    (tmp_path / "torn.jsonl").write_text('{"text": "a dog"}\n{"text": \n')
    assert "torn.jsonl:2 is not valid JSON" in tokenize_error(tmp_path, ckpt, [tmp_path / "torn.jsonl"])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    plain = word_tokenizer(tmp_path / "plain", template=None)
    assert "has no chat template, which chat ('messages') and conversational prompt/completion records need" in \
        tokenize_error(tmp_path, ckpt, [chat], model=plain)
    # a template that renders earlier turns differently once later ones exist
    shifting = word_tokenizer(tmp_path / "shifting", template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last %} the{% endif %}<|im_end|>\n{% endfor %}"))
    assert ":1: the chat template does not render the conversation up to messages[2] as the start" in \
        tokenize_error(tmp_path, ckpt, [chat], model=shifting)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "r.parquet").write_bytes(b"PAR1")
    assert "reading .parquet files needs pyarrow: pip install pyarrow" in \
        tokenize_error(tmp_path, ckpt, [tmp_path / "r.parquet"])
    monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "ds").mkdir()
    assert "reading it needs the datasets package: pip install datasets" in \
        tokenize_error(tmp_path, ckpt, [tmp_path / "ds"])


def test_document_files_are_checked(tmp_path, ckpt):
    out = str(tmp_path / "c.npy")
    tokenize(ckpt, [write_jsonl(tmp_path / "c.jsonl", records())], out)
    with pytest.raises(ValueError, match=r"document 1 \(from token 7\) has token id 16 >= the model's vocab_size=16"):
        open_documents(out, 16)  # "are", in the second document
    np.save(sibling(out, "docs"), np.array([0, 60]))
    with pytest.raises(ValueError, match="document starts must ascend from 0 and stay below the 52 ids"):
        open_documents(out, 256)
    with pytest.raises(SystemExit, match="--pack needs a document file: the built-in copy task has none"):
        main(["train", "--pack", *SMALL])


def test_chat_labels_reach_the_engine_loss_as_transformers_reads_them(tmp_path, ckpt):
    """-100 outside the assistant's tokens: the engine's loss is transformers' on the same labels."""
    from oomb import ChunkRecurrentEngine
    from oomb.presets import load_model

    out = str(tmp_path / "c.npy")
    tokenize(ckpt, [write_jsonl(tmp_path / "c.jsonl", records())], out)
    docs = open_documents(out, 256)
    ids, labels, _ = (torch.from_numpy(x)[None] for x in sequence(docs, [1], 48))
    assert (labels[0, :31] != IGNORE_INDEX).sum() == 11 and (labels[0, 31:] == IGNORE_INDEX).all()
    torch.manual_seed(0)
    model = load_model("tiny", dtype=torch.float32, device=torch.device("cpu")).eval()
    engine = ChunkRecurrentEngine(model, chunk_size=16, page_size=8, backend="torch")
    got = engine.evaluate(ids, labels)
    assert got.num_tokens == 11
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
    assert float(got.loss) == pytest.approx(float(want), rel=1e-5)


def recording_positions(method, calls: list):
    """`method`, recording the position_ids it is given in `calls`."""
    def wrapped(self, *args, position_ids=None, **kwargs):
        calls.append(position_ids)
        return method(self, *args, position_ids=position_ids, **kwargs)
    return wrapped


def test_train_on_chat_data(tmp_path, ckpt, capsys, monkeypatch):
    """--no-pack: one conversation per sequence, padded, trains on the assistant's tokens. Packed
    (the default for chat data): the packed batches' position_ids reach forward_backward and
    evaluate (held-out batches), which mask each document to itself."""
    from oomb.engine import ChunkRecurrentEngine

    rows = records() * 3
    out = str(tmp_path / "chat.npy")
    main(["tokenize", write_jsonl(tmp_path / "chat.jsonl", rows), "--model", ckpt, "--output", out])
    assert "wrote 156 tokens (12 documents, 6 of them chats; 72 tokens trained)" in capsys.readouterr().out
    main(["train", "--data", out, "--no-pack", "--steps", "2", *SMALL])
    assert re.search(r"step +2/2 +loss \d+\.\d+", capsys.readouterr().out)

    seen = {"forward_backward": [], "evaluate": []}
    for name in seen:
        monkeypatch.setattr(ChunkRecurrentEngine, name, recording_positions(getattr(ChunkRecurrentEngine, name),
                                                                            seen[name]))
    main(["train", "--data", out, "--steps", "2", "--eval-every", "2", *SMALL])
    assert re.search(r"step +2/2 +loss \d+\.\d+", capsys.readouterr().out)
    data = make_data(out, 256, 64, 1, seed=0)  # the trainer's stream: packed, seed 0
    held_out = make_data(out, 256, 64, 1, seed=7_919)  # its held-out batch
    assert len(seen["forward_backward"]) == 2 and len(seen["evaluate"]) == 1
    assert all(torch.equal(p, next(data)[2]) for p in seen["forward_backward"])
    assert torch.equal(seen["evaluate"][0], next(held_out)[2])
