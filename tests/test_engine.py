"""The truth test: chunk-recurrent loss and gradients equal transformers' full-sequence training."""
import pytest
import torch

import oomb
from tiny_models import VOCAB, assert_grads_match, full_sequence_grads, llama_with_rope, make_model, rel_err

TOL = 1e-4  # relative, float32 (the bound; measured errors are ~1e-6)


def check_against_full_sequence(model, input_ids, labels, **engine_kwargs):
    ref_loss, ref_grads = full_sequence_grads(model, input_ids, labels)
    engine = oomb.ChunkRecurrentEngine(model, **engine_kwargs)
    result = engine.forward_backward(input_ids, labels)
    assert rel_err(result.loss, ref_loss) <= TOL, (result.loss, ref_loss)
    expected_tokens = int((labels[:, 1:] != -100).sum())
    assert result.num_tokens == expected_tokens
    assert_grads_match(model, ref_grads, TOL)
    model.zero_grad(set_to_none=True)
    return result


def random_batch(batch, seq_len, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("seq_len,chunk_size,page_size", [
    (256, 64, 16),   # multiple of chunk and page
    (203, 64, 16),   # neither: partial last chunk and partial last page
    (97, 32, 32),    # chunk == page
    (50, 128, 16),   # chunk_size >= seq_len: one chunk
])
def test_gradients_equal_full_sequence(family, seq_len, chunk_size, page_size):
    model = make_model(family)
    ids = random_batch(1, seq_len)
    check_against_full_sequence(model, ids, ids, chunk_size=chunk_size, page_size=page_size, backend="torch")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_batch_two_with_ignored_spans(family):
    model = make_model(family)
    ids = random_batch(2, 150, seed=3)
    labels = ids.clone()
    labels[0, 10:20] = -100
    labels[1, 60:70] = -100  # across the chunk boundary at 64
    labels[1, 127:129] = -100  # the first label of chunk 2 (predicted by the last token of chunk 1)
    check_against_full_sequence(model, ids, labels, chunk_size=64, page_size=16, backend="torch")


def test_peft_lora_only_adapter_grads():
    peft = pytest.importorskip("peft")
    model = make_model("qwen2")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj"]))
    # LoRA B starts at zero; make it non-zero so adapters change the forward.
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = random_batch(1, 170)
    check_against_full_sequence(lora, ids, ids, chunk_size=64, page_size=16, backend="torch")
    assert all(p.grad is None for p in lora.parameters() if not p.requires_grad)


def test_lora_dropout_recompute_is_consistent():
    """With dropout, stage 2 must redraw stage 1's masks, or the recomputed chunk differs from
    the K/V that later chunks attended to. Layer 0's v_proj output is recorded per call:
    stage 1 runs chunks 0..n-2, stage 2 chunks n-1..0; each chunk's two outputs must match."""
    peft = pytest.importorskip("peft")
    model = make_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    lora.train()
    outputs = []
    v_proj = lora.get_base_model().model.layers[0].self_attn.v_proj
    v_proj.register_forward_hook(lambda mod, inp, out: outputs.append(out.detach().clone()))
    engine = oomb.ChunkRecurrentEngine(lora, chunk_size=32, page_size=16, backend="torch")
    engine.forward_backward(random_batch(1, 130))  # 5 chunks
    n = 5
    stage1, stage2 = outputs[: n - 1], outputs[n - 1 :][::-1]
    assert len(stage2) == n
    for c in range(n - 1):
        assert torch.equal(stage1[c], stage2[c]), f"chunk {c} recomputed with other dropout masks"


def test_grad_accumulates_like_backward():
    model = make_model("qwen2")
    ids = random_batch(1, 100)
    _, ref = full_sequence_grads(model, ids, ids)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    engine.forward_backward(ids)
    engine.forward_backward(ids)  # .grad now holds twice the gradient
    for n, p in model.named_parameters():
        assert rel_err(p.grad, 2 * ref[n]) <= TOL, n


def test_num_tokens_normalisation_for_accumulation():
    model = make_model("qwen2")
    ids = random_batch(2, 80)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    whole = engine.forward_backward(ids)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # Two micro-batches normalised by the global count give the same gradient.
    for i in range(2):
        engine.forward_backward(ids[i : i + 1], num_tokens=whole.num_tokens)
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref[n]) <= TOL, n


def test_repeated_steps_reuse_the_pool():
    model = make_model("qwen2")
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    engine.forward_backward(random_batch(1, 200))
    slots = engine.store.pool.n_slots
    engine.forward_backward(random_batch(1, 120))
    assert engine.store.pool.n_slots == slots  # shorter step: no re-allocation
    assert engine.store.pool.n_free == slots  # every page freed after the step


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_evaluate_equals_full_sequence_loss(family):
    model = make_model(family)
    ids = random_batch(2, 150)
    labels = ids.clone()
    labels[:, 30:70] = -100
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels).loss
    result = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16).evaluate(ids, labels)
    assert rel_err(result.loss, ref) <= TOL
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("group_pages", [1, 3])
def test_page_groups_merge_exactly(group_pages):
    """Pages attended a group at a time (the unit offload moves) merge by their LSEs."""
    model = make_model("qwen3")
    ids = random_batch(2, 203)
    check_against_full_sequence(model, ids, ids, chunk_size=64, page_size=16, backend="torch",
                                group_pages=group_pages)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_triton_backend_equals_full_sequence(family):
    """The Triton kernels (interpreted on CPU, float32) inside the engine: same truth test."""
    model = make_model(family)
    ids = random_batch(2, 150)
    labels = ids.clone()
    labels[1, 60:70] = -100
    check_against_full_sequence(model, ids, labels, chunk_size=64, page_size=16, backend="triton", group_pages=3)


def test_bf16_gradient_pages_are_close():
    """kv_grad_dtype=bf16 halves the gradient pages; accumulation rounds to bf16 (8 bits of
    mantissa) once per later chunk, so gradients stay within ~1e-2 of full-sequence training."""
    model = make_model("qwen2")
    ids = random_batch(1, 256)
    _, ref = full_sequence_grads(model, ids, ids)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch",
                                       kv_grad_dtype=torch.bfloat16)
    assert engine.store.spec.grad_bytes * 2 == oomb.PageSpec(16, 1, 16, torch.float32).grad_bytes
    engine.forward_backward(ids)
    errors = {n: rel_err(p.grad, ref[n]) for n, p in model.named_parameters()}
    assert max(errors.values()) < 2e-2, errors
    assert max(errors.values()) > TOL  # bf16 rounding is visible: the pages really are bf16


@pytest.mark.parametrize("backend,kwargs", [
    ("torch", {}), ("triton", {"offload": "all", "group_pages": 2}),
    ("torch", {"offload": "all", "sparse": oomb.TopKPages(budget=2, block_queries=16, chunk_budget=3)}),
])
def test_checkpoint_layers_gives_identical_gradients(backend, kwargs):
    """Recomputing each layer in backward (the minimum-memory setting) changes no bit, with
    LoRA dropout (its masks redrawn from the saved RNG state) and with offloaded pages."""
    import peft
    model = peft.get_peft_model(make_model("qwen2"), peft.LoraConfig(
        r=4, lora_dropout=0.3, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    # one sequence under the Triton interpreter (it runs a program at a time)
    ids = torch.randint(0, VOCAB, (1 if backend == "triton" else 2, 150), generator=torch.Generator().manual_seed(8))
    results = []
    for checkpoint_layers in (False, True):
        torch.manual_seed(0)
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend=backend,
                                           checkpoint_layers=checkpoint_layers, **kwargs)
        loss = engine.forward_backward(ids).loss
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad(set_to_none=True)
    (loss0, g0), (loss1, g1) = results
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys() and g0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
     "original_max_position_embeddings": 64},
])
def test_length_dependent_rope_equals_full_sequence(rope):
    """Dynamic NTK and LongRoPE choose their frequencies from the sequence length: every chunk
    must rotate as the whole sequence does (a chunk alone shows the rotary module a shorter
    length, and both cases fail without the engine passing the sequence's)."""
    model = llama_with_rope(rope, 64)
    ids = random_batch(1, 300)  # well past the 64 positions the frequencies were made for
    check_against_full_sequence(model, ids, ids, chunk_size=32, page_size=16, backend="torch")


def test_progress_reports_every_chunk_pass():
    """progress(done, total): stage 1's n - 1 chunks then stage 2's n, counted 1 .. 2n - 1;
    evaluate() reports its n chunks; the loss is the same with or without a callback."""
    model = make_model("qwen2")
    ids = random_batch(1, 200)  # chunks of 64: 4
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16, backend="torch")
    calls = []
    loss = engine.forward_backward(ids, progress=lambda done, total: calls.append((done, total))).loss
    assert calls == [(i, 7) for i in range(1, 8)]
    model.zero_grad(set_to_none=True)
    assert torch.equal(engine.forward_backward(ids).loss, loss)
    calls.clear()
    engine.evaluate(ids, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 4) for i in range(1, 5)]


@pytest.mark.parametrize("offload", ["none", "all"])
def test_evaluation_only_engine_has_no_gradient_pages(offload):
    """kv_grad_dtype=None: pages hold K/V only (device pool and host arena), evaluate() gives
    the loss of an ordinary engine bitwise, and forward_backward() refuses with the fix."""
    model = make_model("qwen2", layers=2)
    ids = random_batch(2, 150)
    ref = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload=offload).evaluate(ids).loss
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload=offload, kv_grad_dtype=None)
    assert torch.equal(engine.evaluate(ids).loss, ref)
    assert engine.spec.page_bytes == engine.spec.kv_bytes and engine.store.dk is None
    if offload == "all":
        arena = engine.store.host.arena.values()
        assert len(arena) == 2 and all(h.dk is None and h.dv is None for h in arena)  # K and V only
        assert all(s.dk is None for s in engine.store.host.staging)
    with pytest.raises(ValueError, match="kv_grad_dtype=None \\(evaluation only"):
        engine.forward_backward(ids)


def test_compiled_layers_equal_full_sequence():
    """compile_layers=True: torch.compile runs the norms, projections, RoPE and MLP (stage 1
    without autograd, stage 2 with, layer recomputation, a shorter last chunk) and the
    gradients still equal transformers' full-sequence training."""
    model = make_model("qwen3", layers=2)  # q/k norms inside the compiled projection
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = full_sequence_grads(model, ids, ids)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16, backend="torch", compile_layers=True,
                                       checkpoint_layers=True)
    loss = engine.forward_backward(ids).loss
    assert rel_err(loss, ref_loss) <= 1e-5
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[n]) <= 1e-4, n
    with pytest.raises(ValueError, match="GptOssForCausalLM layers are not compiled"):
        oomb.ChunkRecurrentEngine(make_model("gpt_oss"), chunk_size=64, page_size=16, compile_layers=True)
    import peft
    lora = peft.get_peft_model(make_model("qwen2"), peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"compile with dropout \(.*lora_dropout.*p=0.1\)"):
        oomb.ChunkRecurrentEngine(lora, chunk_size=64, page_size=16, compile_layers=True)


def test_param_grad_dtype_sums_bf16_chunk_gradients_in_fp32():
    """bf16 weights: each parameter's gradient is a sum over the chunks, rounded to bf16 at every
    add by default. param_grad_dtype=torch.float32 sums in fp32 and rounds once: against exact
    (float64) sums of the same chunk gradients it is within a bf16 rounding, the default several
    times further off; a .grad already there (an earlier micro-batch) starts the sum."""
    model = make_model("qwen2", dtype=torch.bfloat16)
    ids = random_batch(1, 2048)
    grads = {}
    for name, wide in (("exact", torch.float64), ("fp32", torch.float32), ("bf16", None)):
        model.zero_grad(set_to_none=True)
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch",
                                           param_grad_dtype=wide)  # 64 chunks
        engine.forward_backward(ids)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
        assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # hooks removed
    err = {k: max(rel_err(grads[k][n], grads["exact"][n]) for n in grads[k]) for k in ("fp32", "bf16")}
    assert err["fp32"] <= 2 ** -8 and err["bf16"] > 3 * err["fp32"], err
    engine.config = engine.config.replace(param_grad_dtype=torch.float32)
    engine.forward_backward(ids)  # onto the bf16-summed .grad of the last loop step
    for n, p in model.named_parameters():
        assert rel_err(p.grad, grads["bf16"][n] + grads["fp32"][n]) <= 2 ** -7, n
    with pytest.raises(ValueError, match="param_grad_dtype=torch.bfloat16 must be None"):
        oomb.ChunkRecurrentEngine(model, param_grad_dtype=torch.bfloat16)


@pytest.mark.parametrize("family,kwargs", [("qwen2", {}), ("qwen2", {"backend": "triton"}), ("gpt_oss", {}),
                                           ("qwen3", {"sparse": oomb.TopKPages(budget=2, block_queries=16)}),
                                           ("llama", {"checkpoint_layers": True})])
def test_kept_attention_skips_stage_twos_forward_with_identical_gradients(family, kwargs, monkeypatch):
    """keep_attention=True: stage 2 takes each layer's output and LSE from stage 1 instead of
    computing the attention forward again (only the last chunk, which has no stage 1, computes
    it): loss and every gradient bitwise those of the default engine; nothing kept afterwards."""
    from oomb.attention import cpu_flash, paged

    ids = random_batch(1, 160)
    results = {}
    for keep in (False, True):
        model = make_model(family)
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, keep_attention=keep,
                                           **{"backend": "torch", **kwargs})
        ops = paged if engine.backend.name == "triton" else cpu_flash
        calls = []
        real = ops.forward
        monkeypatch.setattr(ops, "forward", lambda *a, **k: calls.append(torch.is_grad_enabled()) or real(*a, **k))
        loss = engine.forward_backward(ids).loss
        monkeypatch.setattr(ops, "forward", real)
        results[keep] = (loss, {n: p.grad for n, p in model.named_parameters()}, len(calls))
        assert engine.kept.n_entries == 0
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results[False], results[True]
    assert torch.equal(loss0, loss1) and all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    # 5 chunks: the first four take stage 1's attention of every layer but the last (stage 1 stops
    # at its K/V); a recomputed layer (checkpoint_layers) would have computed it twice
    assert calls0 - calls1 == 4 * (2 - 1) * (2 if kwargs.get("checkpoint_layers") else 1)
    from oomb.plan import plan  # counts what the engine checks for the kept outputs
    pages_per_chunk = 2  # chunk 32, page 16: 4 stored chunks
    assert engine.memory.attention_bytes(1, 4 * pages_per_chunk) == plan(
        model.config, 160, chunk_size=32, page_size=16, dtype=torch.float32, keep_attention=True).kept_attention


@pytest.mark.parametrize("offload", ["none", "all"])
def test_kept_attention_on_the_host(offload, monkeypatch):
    """The host arena path (a CPU model's kept outputs always take it; on a GPU when they do not
    fit beside the pages): with a budget for 2 of 3 layers, keep_attention=None keeps the first
    two, each entry in its own slot of one block (a wrong offset overlaps two entries), and stage
    2 skips exactly their attention forwards; loss and gradients bitwise those of keeping nothing. keep_attention=True with that budget is refused before any
    compute, naming what it needs."""
    from oomb.attention import cpu_flash
    from oomb.memory.kept import KeptAttention

    ids = random_batch(2, 160)  # 5 chunks: 4 stored
    entry = KeptAttention.entry_bytes(2, 32, 4, 16, 4)  # B=2, C=32, 4 query heads of 16, fp32
    results = {}
    for keep, budget in ((False, None), (None, KeptAttention.host_bytes(2 * 4, entry))):
        model = make_model("qwen2", layers=4)
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload=offload,
                                           keep_attention=keep, kept_host_bytes=budget)
        calls = []
        real = cpu_flash.forward
        monkeypatch.setattr(cpu_flash, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
        loss = engine.forward_backward(ids).loss
        monkeypatch.setattr(cpu_flash, "forward", real)
        results[keep] = (loss, {n: p.grad for n, p in model.named_parameters()}, len(calls))
    assert engine.kept.layers == (0, 1) and engine.kept.where == "host" and engine.keeps_attention
    assert engine.kept.arena_bytes == KeptAttention.host_bytes(8, entry) == 8 * entry and engine.kept.n_entries == 0
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results[False], results[None]
    assert torch.equal(loss0, loss1) and all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    assert calls0 - calls1 == 4 * 2  # 4 stored chunks x 2 kept layers
    engine.config = engine.config.replace(keep_attention=True)
    with pytest.raises(ValueError, match=r"keep_attention=True: the attention outputs of 3 layers need "
                                         r".* 2 layers would fit"):
        engine.forward_backward(ids)


def test_kept_attention_split_between_gpu_and_host(monkeypatch):
    """On a GPU, as many layers' outputs as fit beside the pages stay there and the next ones go
    to the host (here: room for 1.5 layers, a host budget for one more); a step with part of
    its kept layers on each side gives keep_attention=False's loss and gradients bitwise."""
    from oomb.memory.kept import KeptAttention

    ids = random_batch(2, 160)  # 5 chunks: 4 stored
    model = make_model("qwen2", layers=4)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="all", keep_attention=None,
                                       kept_host_bytes=KeptAttention.host_bytes(4, KeptAttention.entry_bytes(
                                           2, 32, 4, 16, 4)))
    pages = 4 * 2
    engine.store.place([0, 1, 2, 3])  # offload 'all': the staging buffers are what the GPU holds
    room = engine.store.device_bytes(2, pages) + int(1.5 * engine.memory.attention_bytes(2, pages, 1))
    monkeypatch.setattr(engine.memory, "device", torch.device("cuda"))  # decides as on a GPU with this room
    monkeypatch.setattr(engine.memory, "headroom", lambda cfg: room)
    monkeypatch.setattr(engine.memory, "check", lambda *a: None)
    monkeypatch.setattr(engine.store, "begin_step", lambda *a: None)
    engine._begin_step(2, pages, training=True)
    assert engine.kept.layers == (0, 1) and engine.kept.host_layers == {1} and engine.kept.where == "gpu+host"
    memory = engine.memory
    assert memory.kept_bytes(2, pages) == memory.attention_bytes(2, pages, 1)
    monkeypatch.undo()

    results = {}
    for keep in (False, None):
        model.zero_grad(set_to_none=True)
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, keep_attention=keep)
        begin = engine.kept.begin_step
        monkeypatch.setattr(engine.kept, "begin_step", lambda layers, host, *a: begin(layers, layers[1:], *a))
        results[keep] = engine.forward_backward(ids).loss, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert engine.kept.layers == (0, 1, 2) and engine.kept.where == "gpu+host"
    (loss0, grads0), (loss1, grads1) = results[False], results[None]
    assert torch.equal(loss0, loss1) and all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def test_kept_attention_when_it_fits():
    """keep_attention=None keeps the outputs when they fit (offload 'none'), never with pages on
    the host, and evaluate() keeps nothing; the gradients are those of keep_attention=False."""
    ids = random_batch(1, 160)
    model = make_model("qwen2")
    grads = {}
    for keep in (False, None):
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, keep_attention=keep)
        engine.forward_backward(ids)
        grads[keep] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        assert engine.keeps_attention is (keep is None)
    assert all(torch.equal(grads[False][n], grads[None][n]) for n in grads[None])
    engine.evaluate(ids)
    assert engine.keeps_attention is False and engine.memory.kept_bytes(1, 8) == 0
    engine.forward_backward(ids)
    assert engine.keeps_attention is True
    host = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="all", keep_attention=None,
                                     kept_host_bytes=0)
    host.forward_backward(ids)
    assert host.keeps_attention is False
