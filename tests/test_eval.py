"""Long-context evaluation (oomb.eval) against brute-force references, on CPU."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import oomb
from oomb.cli import main
from oomb.data.codec import ByteCodec
from oomb.data.documents import write_documents
from oomb.data.needles import check_template, hits, make_needle, with_needles
from oomb.data.tokens import windows
from oomb.eval import plots, position_loss, retrieval, selection_recall
from tiny_models import VOCAB, make_model


def save_checkpoint(tmp_path, family="qwen2", layers=2, vocab=VOCAB):
    model = make_model(family, layers=layers, vocab=vocab)
    model.config.max_position_embeddings = 4096
    path = tmp_path / family
    model.save_pretrained(path)
    return model, str(path)


def token_file(tmp_path, n, seed=0, vocab=VOCAB):
    tokens = np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    return tokens, str(path)


def test_position_loss_equals_transformers_bucketed(tmp_path, capsys):
    """`oomb eval --task position-loss` on a saved checkpoint and a token file: each bucket's mean
    is transformers' per-token cross entropy over the same positions (fp32, <= 1e-4)."""
    model, path = save_checkpoint(tmp_path)
    seq_len = 300
    tokens, data = token_file(tmp_path, 2 * seq_len + 1)  # exactly two windows
    main(["eval", "--model", path, "--data", data, "--task", "position-loss", "--seq-len", str(seq_len),
          "--batches", "5", "--chunk-size", "64", "--page-size", "16", "--buckets", "0,10,64,256", "--device", "cpu",
          "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = torch.from_numpy(tokens[: 2 * seq_len].astype(np.int64)).view(2, seq_len)  # windows from the start
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # ce[:, p - 1]: target p
    edges = [0, 10, 64, 256, seq_len]
    assert [(b["start"], b["end"]) for b in result["buckets"]] == list(zip(edges[:-1], edges[1:]))
    for b in result["buckets"]:
        lo = max(b["start"], 1)
        ref = ce[:, lo - 1 : b["end"] - 1]
        assert b["tokens"] == ref.numel()
        assert abs(b["loss"] - ref.mean().item()) <= 1e-4, b
    assert abs(result["loss"] - ce.mean().item()) <= 1e-4 and result["tokens"] == 2 * (seq_len - 1)


@pytest.mark.filterwarnings("ignore:.*documents have no trained token")  # the 1-token document
def test_eval_of_a_document_file_scores_each_document_alone(tmp_path, capsys):
    """`oomb eval` on a chat document file (ids, starts, mask): the loss is transformers' cross
    entropy of each document run alone, over its masked-in targets only; position-loss buckets
    each target by its position in its own document (fp32, <= 1e-4)."""
    model, path = save_checkpoint(tmp_path)
    rng = np.random.default_rng(3)
    lengths = [1, 5, 40, 130, 17, 90, 200, 61]  # packed into sequences of 256, off the page and chunk grid
    ids = rng.integers(0, VOCAB, sum(lengths)).astype(np.uint16)
    starts = np.cumsum([0] + lengths[:-1])
    mask = rng.random(len(ids)) < 0.6
    data = str(tmp_path / "chat.npy")
    write_documents(data, ids, starts, mask)
    ce, at = [], []  # every scored target's cross entropy and its position in its document
    for s, n in zip(starts, lengths):
        doc = torch.from_numpy(ids[s : s + n].astype(np.int64))[None]
        with torch.no_grad():
            logits = model(input_ids=doc).logits.float()[0, :-1]
        keep = torch.from_numpy(mask[s + 1 : s + n])
        ce.append(F.cross_entropy(logits, doc[0, 1:], reduction="none")[keep])
        at.append(torch.arange(1, n)[keep])
    ce, at = torch.cat(ce), torch.cat(at)
    common = ["--model", path, "--data", data, "--seq-len", "256", "--batches", "9", "--chunk-size", "64",
              "--page-size", "16", "--device", "cpu", "--json"]
    main(["eval", "--task", "loss", *common])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == len(ce) and abs(result["loss"] - ce.mean().item()) <= 1e-4
    main(["eval", "--task", "position-loss", "--buckets", "0,8,64", *common])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for b, (lo, hi) in zip(result["buckets"], [(0, 8), (8, 64), (64, 256)]):
        ref = ce[(at >= lo) & (at < hi)]
        assert (b["start"], b["end"], b["tokens"]) == (lo, hi, len(ref))
        assert abs(b["loss"] - ref.mean().item()) <= 1e-4, b
    with pytest.raises(SystemExit, match="selection-recall measures attention over whole sequences"):
        main(["eval", "--task", "selection-recall", "--sparse-budget", "2", *common])


def test_eval_windows_are_deterministic_and_non_overlapping():
    data = np.arange(10 * 7 + 1)
    got = [ids for ids, _ in windows(data, 7, 3)]
    assert [g.shape[0] for g in got] == [3, 3, 3, 1]
    assert torch.equal(torch.cat(got).flatten(), torch.arange(70))
    assert len(list(windows(np.arange(8), 7, 1))) == 1  # seq_len + 1 tokens: one window
    assert len(list(windows(np.arange(7), 7, 1))) == 0


def test_default_buckets_and_their_checks():
    assert position_loss.default_buckets(4096) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert position_loss.default_buckets(5000)[-1] == 4096
    with pytest.raises(ValueError, match="bucket starts must be increasing"):
        position_loss.check_buckets([0, 64, 32], 100)
    with pytest.raises(ValueError, match="< seq_len=100"):
        position_loss.check_buckets([0, 100], 100)


def test_retrieval_scoring_on_constructed_predictions():
    codec = ByteCodec()
    rng = np.random.default_rng(0)
    needle = make_needle(codec, "key {key} = {value};", rng, key_len=3, value_len=4)
    assert bytes(needle.tokens.astype(np.uint8)).decode() == f"key {needle.key} = {needle.value};"
    haystack = np.full(100, ord("."))
    tokens, spans = with_needles(haystack, [needle], [0.5], 80)
    assert len(tokens) == 80
    s, e = spans[0]
    assert bytes(tokens[s:e].astype(np.uint8)).decode() == needle.value and e == 80  # the query ends the sequence
    text = bytes(tokens.astype(np.uint8)).decode()
    assert text.count(f"key {needle.key} = {needle.value};") == 1  # the needle, near the middle
    assert abs(text.index(f"key {needle.key}") - (80 - len(needle.tokens) - (e - s) - len(needle.query)) / 2) <= 1
    perfect = tokens.copy()
    assert hits(perfect, tokens, spans) == [True]
    one_off = tokens.copy()
    one_off[e - 1] += 1  # the last value token wrong: a miss, though the others are right
    assert hits(one_off, tokens, spans) == [False]
    shifted = np.roll(tokens, 1)  # predictions of the previous token: wrong everywhere
    assert hits(shifted, tokens, spans) == [False]
    first = with_needles(haystack, [needle], [0.0], 80)[0]
    assert bytes(first[: len(needle.tokens)].astype(np.uint8)).decode() == f"key {needle.key} = {needle.value};"
    with pytest.raises(ValueError, match="must hold {key} and then exactly one {value}"):
        check_template("{value} for {key}")
    with pytest.raises(ValueError, match="too short"):
        with_needles(haystack, [needle], [0.5], 10)


def test_retrieval_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """`oomb eval --task retrieval` on a saved checkpoint and a token file: every cell's hits are
    those of transformers' argmax on the same sequences (the needle in window s of the file, the
    query at the end), and accuracy = hits / samples."""
    model, path = save_checkpoint(tmp_path, layers=1, vocab=256)  # a byte-level vocabulary
    tokens, data = token_file(tmp_path, 2 * 512 + 1, vocab=256)
    template = "k{key}={value};"
    main(["eval", "--model", path, "--data", data, "--task", "retrieval", "--lengths", "256,512", "--depths", "0,1",
          "--samples", "2", "--chunk-size", "128", "--page-size", "16", "--device", "cpu", "--tokenizer", "bytes",
          "--needle-template", template, "--json", "--plot", str(tmp_path / "r.png")])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["lengths"] == [256, 512] and result["depths"] == [0.0, 1.0]
    assert len(result["accuracy"]) == 2 and all(len(r) == 2 for r in result["accuracy"])
    for cell in result["cells"]:
        seqs, spans = retrieval.retrieval_cell(tokens, ByteCodec(), template, cell["length"], cell["depth"], 2, 1, 256)
        ids = torch.from_numpy(np.stack(seqs))
        assert torch.equal(ids[0, : cell["length"] // 2], torch.from_numpy(tokens[: cell["length"] // 2].astype(np.int64))) \
            or cell["depth"] == 0  # the haystack is the file's window (the needle at depth 0 comes first)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        pred = np.concatenate([np.full((2, 1), -1), logits[:, :-1].argmax(-1).numpy()], axis=1)
        expected = sum(hits(pred[b], seqs[b], [spans[b]])[0] for b in range(2))
        ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        answer_loss = np.mean([ce[b, spans[b][0] - 1 : spans[b][1] - 1].mean().item() for b in range(2)])
        assert cell["hits"] == expected and cell["accuracy"] == expected / 2
        assert abs(cell["answer_loss"] - answer_loss) <= 1e-4
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_token_predictions_equal_transformers_argmax():
    model = make_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16, backend="torch", kv_grad_dtype=None)
    labels = ids.clone()
    labels[:, :40] = -100
    r = engine.evaluate(ids, labels, per_token=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    assert torch.equal(r.predictions[:, 1:], logits[:, :-1].argmax(-1)) and (r.predictions[:, 0] == -1).all()
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert torch.isnan(r.token_losses[:, :40]).all()  # p = 0 and labels of -100 predict nothing
    assert torch.allclose(r.token_losses[:, 40:], ce[:, 39:], atol=1e-5)  # ce[:, p - 1]: target p
    assert abs(float(r.loss) - ce[:, 39:].mean().item()) < 1e-5


def sparse_forward_probabilities(model, ids, selections, chunk, page, block, dense, logits=False):
    """Brute force: the model run layer by layer over the whole sequence with the engine's top-k
    pattern as an explicit mask (the selected pages of each query block and its own chunk,
    causal; dense layers causal only), and at each layer the exact causal softmax of its queries
    over every key, (B, H, T, T): the distribution selection recall compares top-k with.
    logits: the forward's logits (B, T, V) instead."""
    from oomb.models import adapter_for
    a = adapter_for(model)
    b, t = ids.shape
    with torch.no_grad():
        h = a.embed_tokens(ids)
        cos, sin = a.rope(h, 0, t)
        probs = []
        for i, layer in enumerate(a.layers):
            q, k, v = a.project_qkv(layer, h, cos, sin)
            n_kv, group = k.shape[1], q.shape[1] // k.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            allowed = causal.expand(b, n_kv, t, t).clone()
            if i not in dense:
                allowed &= torch.zeros_like(allowed)
                for start in range(0, t, chunk):
                    c = start // chunk
                    allowed[:, :, start : start + chunk, start : start + chunk] = causal[:chunk, :chunk]
                    if c == 0:
                        continue
                    picks = selections[c, i].logical().long()  # (B, Hkv, n_blocks, budget)
                    for qi in range(start, min(t, start + chunk)):
                        for bi in range(b):
                            for kv in range(n_kv):
                                for pg in picks[bi, kv, (qi - start) // block].tolist():
                                    allowed[bi, kv, qi, pg * page : (pg + 1) * page] = True
            s = torch.einsum("bkgtd,bksd->bkgts", q.reshape(b, n_kv, group, t, -1), k).double() * a.scale
            probs.append(s.masked_fill(~causal, float("-inf")).softmax(-1).reshape(b, -1, t, t))
            o = torch.einsum("bkgts,bksd->bkgtd", s.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1),
                             v.double()).reshape(q.shape).to(q.dtype)
            h = a.finish_layer(layer, h, o)
        if logits:
            return a.lm_head(a.norm(h)).float()
    return probs


@pytest.mark.parametrize("budget,dense_layers", [(2, ()), (3, (-1,))])
def test_selection_recall_equals_brute_force_from_full_attention(budget, dense_layers):
    """Each sampled query block's recall equals the one computed by brute force from the full
    attention probabilities of the same forward (top-k as an explicit mask) and the engine's own
    selections."""
    model = make_model("qwen2_tp", layers=3)  # 2 KV heads of 2 query heads each
    chunk, page, t = 64, 16, 256
    ids = torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(5))
    sparse = oomb.TopKPages(budget=budget, block_queries=16, dense_layers=dense_layers)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=chunk, page_size=page, backend="torch", sparse=sparse,
                                       kv_grad_dtype=None)
    chunks = selection_recall.recall_chunks(t, chunk, page, budget, 8)
    assert chunks == {1, 2, 3}
    probe = selection_recall.RecallProbe(chunks, 2, 16, page, engine.adapter.scale, seed=3)
    engine.evaluate(ids, probe=probe)
    selections = dict(engine._selection)  # kept until the next step
    dense = sparse.dense_set(3)
    probs = sparse_forward_probabilities(model, ids, selections, chunk, page, 16, dense)
    layers_seen = {r["layer"] for r in probe.rows}
    assert layers_seen == {0, 1, 2} - dense
    assert len(probe.rows) == 3 * len(layers_seen) * 2
    for row in probe.rows:
        c, i, blk = row["chunk"], row["layer"], row["block"]
        picks = selections[c, i].logical()[:, :, blk].long()  # (B, Hkv, budget)
        lo, hi = c * chunk + blk * 16, c * chunk + (blk + 1) * 16
        p = probs[i][:, :, lo:hi]  # (B, H, 16, T)
        group = p.shape[1] // picks.shape[1]
        keep = torch.zeros(p.shape[0], p.shape[1], t, dtype=torch.bool)
        keep[:, :, c * chunk :] = True  # the chunk's own keys (causal: later ones have p = 0)
        for b in range(p.shape[0]):
            for h in range(p.shape[1]):
                for pg in picks[b, h // group].tolist():
                    keep[b, h, pg * page : (pg + 1) * page] = True
        mass = (p * keep[:, :, None]).sum(-1)
        earlier = p[..., : c * chunk].sum(-1)
        on_selected = (p[..., : c * chunk] * keep[:, :, None, : c * chunk]).sum(-1)
        assert abs(row["recall"] - mass.mean().item()) <= 1e-5, row
        assert abs(row["earlier_recall"] - (on_selected / earlier).mean().item()) <= 1e-5, row
        assert abs(row["earlier_mass"] - earlier.mean().item()) <= 1e-5, row
    assert any(r["recall"] < 0.999 for r in probe.rows)  # the budget really drops pages


def test_selection_recall_task_needs_sparse_and_a_long_enough_sequence():
    model = make_model("qwen2")
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16, backend="torch", kv_grad_dtype=None)
    with pytest.raises(ValueError, match="pass --sparse-budget"):
        selection_recall.selection_recall(engine, [], 256)
    with pytest.raises(ValueError, match="no chunk with more than budget=64"):
        selection_recall.recall_chunks(256, 64, 16, 64, 8)


def test_plots_write_pngs(tmp_path):
    pl = {"task": "position-loss", "buckets": [{"start": 1, "end": 2, "tokens": 3, "loss": 5.0},
                                               {"start": 2, "end": 4, "tokens": 3, "loss": 4.0}]}
    plots.position_loss({"a": pl, "b": pl}, str(tmp_path / "p.png"))
    rec = {"budget": 4, "layers": [{"layer": 0, "recall": 0.9}, {"layer": 1, "recall": 0.8}]}
    plots.selection_recall({"a": rec}, str(tmp_path / "s.png"))
    for name in ("p.png", "s.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def mean_logit_task():
    """A task as a user adds one: its own flag, a run over the shared inputs, a report. Mean of the
    logit of token --logit-id over every position of the evaluated sequences (the model run whole)."""
    from oomb.eval import EvalTask
    from oomb.eval.inputs import BATCHES, eval_batches

    def run(args, engine, progress):
        total, n = 0.0, 0
        for ids, *_ in eval_batches(args, engine.adapter.vocab_size):
            with torch.no_grad():
                logits = engine.model(input_ids=ids).logits.double()[..., args.logit_id]  # (B, T)
            total, n = total + float(logits.sum()), n + logits.numel()
        return {"task": "mean-logit", "logit_id": args.logit_id, "positions": n, "mean_logit": total / n}

    return EvalTask("mean-logit", "the mean logit of one token id", run=run,
                    report=lambda r: [f"mean logit of id {r['logit_id']} {r['mean_logit']:.4f}"],
                    flags={"--batches": BATCHES, "--logit-id": {"type": int, "default": 0, "help": "the token id"}})


def test_a_registered_task_runs_through_the_cli(tmp_path, capsys):
    """An eval task defined here and registered: `oomb eval --task mean-logit` takes its flag, runs it
    on the windows of the token file, prints its report after the shared head and its result as
    JSON (the mean of transformers' logits, fp32); --plot is refused for it before any work."""
    from oomb.eval import TASKS, register
    from oomb.eval.registry import EvalTask

    model, path = save_checkpoint(tmp_path)
    tokens, data = token_file(tmp_path, 3 * 64 + 1)
    register(mean_logit_task())
    try:
        main(["eval", "--task", "mean-logit", "--logit-id", "5", "--model", path, "--data", data, "--seq-len", "64",
              "--batch", "2", "--batches", "2", "--chunk-size", "32", "--page-size", "16", "--device", "cpu", "--json"])
        out = capsys.readouterr().out.strip().splitlines()
        result = json.loads(out[-1])
        ids = torch.from_numpy(tokens[: 3 * 64].astype(np.int64)).view(3, 64)  # the file's 3 windows, 2 a call
        with torch.no_grad():
            ref = model(input_ids=ids).logits.double()[..., 5].mean().item()
        assert result["positions"] == 3 * 64 and abs(result["mean_logit"] - ref) <= 1e-5
        assert out[-2] == f"mean-logit: {path} on {data}, dense attention: mean logit of id 5 {ref:.4f}"
        with pytest.raises(SystemExit, match="--task mean-logit draws no plot; leave out --plot"):
            main(["eval", "--task", "mean-logit", "--model", path, "--data", data, "--plot", str(tmp_path / "p.png")])
        assert capsys.readouterr().out == ""
        clash = EvalTask("clash", "x", run=None, report=None, flags={"--logit-id": {"type": str, "help": "other"}})
        with pytest.raises(ValueError, match="'clash' declares --logit-id otherwise than 'mean-logit'"):
            register(clash)
    finally:
        TASKS.pop("mean-logit")
    assert "clash" not in TASKS
    with pytest.raises(SystemExit):  # gone from the choices with it
        main(["eval", "--task", "mean-logit"])
