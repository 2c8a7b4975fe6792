"""The engine on the GPU, bf16 (run with `pytest -m gpu` on the H200)."""
import traceback
import warnings
from collections import Counter

import pytest
import torch

import oomb
from tiny_models import rel_err

pytestmark = pytest.mark.gpu
# one page of Qwen2.5-7B shape: 4 KV heads x 128 tokens x 128 dims x (K, V bf16 + dK, dV fp32)
PAGE_BYTES = 4 * 128 * 128 * (2 + 2 + 4 + 4)


@pytest.fixture(scope="module")
def wide_model():
    """2 layers of Qwen2.5-7B width (hidden 3584, 28 heads, 4 KV heads, vocab 152K), bf16."""
    from oomb.presets import load_model
    torch.manual_seed(0)
    model = load_model("qwen2.5-7b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=2)
    model.config._attn_implementation = "sdpa"
    return model.train()


def grads_of(model):
    out = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def fp32_copy(model):
    ref = {n: p.detach().float() for n, p in model.named_parameters()}
    with torch.device("cuda"):
        fp32 = type(model)(model.config).float()
    fp32.load_state_dict(ref)
    fp32.config._attn_implementation = "sdpa"
    return fp32.train()


def test_bf16_engine_matches_full_sequence_at_8k(wide_model):
    ids = torch.randint(0, 152064, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    # Truth: transformers in fp32 (a copy of the same weights).
    fp32 = fp32_copy(wide_model)
    loss32 = fp32(input_ids=ids, labels=ids).loss
    loss32.backward()
    truth = grads_of(fp32)
    del fp32
    # What plain transformers makes in bf16 against that truth.
    loss_hf = wide_model(input_ids=ids, labels=ids).loss
    loss_hf.backward()
    hf = grads_of(wide_model)
    engine = oomb.ChunkRecurrentEngine(wide_model, chunk_size=2048, page_size=128, backend="triton")
    result = engine.forward_backward(ids)
    ours = grads_of(wide_model)
    assert abs(float(result.loss) - float(loss32)) <= 3 * abs(float(loss_hf) - float(loss32)) + 2e-3
    for n in truth:
        e_ours, e_hf = rel_err(ours[n], truth[n]), rel_err(hf[n], truth[n])
        assert e_ours <= 3 * e_hf + 1e-3, f"{n}: oomb {e_ours:.2e} vs transformers bf16 {e_hf:.2e}"


def test_packed_bf16_matches_documents_alone_at_32k(wide_model):
    """Packed documents (position_ids) at 32K, the Triton kernels in bf16: loss and every gradient
    within 3x of transformers-bf16's own error against transformers-fp32, each trained on each
    document alone (sizes of 1 token, under a page, and across several chunks, off the grid)."""
    # Documents of at most ~9K tokens: transformers' fp32 SDPA materialises each one's
    # (heads, n, n) scores (23 GiB at 15K tokens, 9 GiB at 9K).
    sizes = [1, 100, 4000, 9001, 3000, 777, 7000]
    sizes.append(32768 - sum(sizes))
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
    spans = list(zip(starts, [s + n for s, n in zip(starts, sizes)]))
    ids = torch.randint(0, 152064, (1, 32768), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    pos = torch.cat([torch.arange(n, device="cuda") for n in sizes])[None]
    total = sum(n - 1 for n in sizes)

    def alone(model):
        loss = 0.0
        for s, e in spans:
            if e - s > 1:
                part = model(input_ids=ids[:, s:e], labels=ids[:, s:e]).loss * (e - s - 1) / total
                part.backward()
                loss += float(part)
        return loss, grads_of(model)

    fp32 = fp32_copy(wide_model)
    loss32, truth = alone(fp32)
    del fp32
    loss_hf, hf = alone(wide_model)
    engine = oomb.ChunkRecurrentEngine(wide_model, chunk_size=4096, page_size=128, backend="triton")
    result = engine.forward_backward(ids, position_ids=pos)
    ours = grads_of(wide_model)
    assert result.num_tokens == total
    assert abs(float(result.loss) - loss32) <= 3 * abs(loss_hf - loss32) + 2e-3
    for n in truth:
        e_ours, e_hf = rel_err(ours[n], truth[n]), rel_err(hf[n], truth[n])
        assert e_ours <= 3 * e_hf + 1e-3, f"{n}: oomb {e_ours:.2e} vs transformers bf16 {e_hf:.2e}"


def test_deterministic_and_offload_identical(wide_model):
    ids = torch.randint(0, 152064, (1, 6000), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    # 6000 tokens, chunk 1024: 5 stored chunks x 8 pages = 40 pages a layer, so 'auto' keeps
    # layer 0 on the GPU and layer 1 on the host.
    assert_offload_modes_identical(wide_model, ids, group_pages=3)


def test_offload_with_layer_recomputation_identical(wide_model):
    """checkpoint_layers: stage 2 loads a layer's pages with their dK/dV when the layer after it
    starts its backward (the previous layer's into the other staging buffer meanwhile), and the
    recomputation and the backward share that load: 'all' and 'auto' equal 'none' bitwise, with
    several groups a layer, one group a layer, and sparse selections."""
    ids = torch.randint(0, 152064, (1, 6000), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    for kwargs in ({"group_pages": 3}, {}, {"sparse": oomb.TopKPages(budget=4, chunk_budget=9)}):
        assert_offload_modes_identical(wide_model, ids, checkpoint_layers=True, **kwargs)


def assert_offload_modes_identical(model, ids, **engine_kwargs):
    """Two runs with offload 'none', one 'all', one 'auto' (one of the 2 layers on the host):
    torch.equal losses and gradients (deterministic kernels, exact transfers)."""
    runs = {}
    for name, kwargs in [("none", {}), ("none again", {}), ("all", {"offload": "all"}),
                         ("auto", {"offload": "auto", "gpu_page_budget_bytes": 40 * PAGE_BYTES})]:
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=1024, page_size=128, **engine_kwargs, **kwargs)
        runs[name] = (engine.forward_backward(ids).loss, grads_of(model))
    loss0, g0 = runs["none"]
    for name, (loss, g) in runs.items():
        assert torch.equal(loss, loss0), name
        for n in g0:
            assert torch.equal(g[n], g0[n]), f"{name}: {n}"


def sync_sites(engine, ids) -> list[str]:
    """Where one step made the host wait for the GPU (torch's sync debug mode): the innermost
    oomb source line of each sync, one entry per sync."""
    sites = []

    def record(message, *args, **kwargs):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack() if "/oomb/" in f.filename]
            sites.append(f"{frames[-1].filename.split('/oomb/')[-1]}:{frames[-1].lineno} {frames[-1].line}"
                         if frames else "outside oomb")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.forward_backward(ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


@pytest.mark.parametrize("kwargs", [
    {},  # dense, pages on the GPU
    {"offload": "all", "group_pages": 2},  # dense, every group staged from the host
    {"sparse": oomb.TopKPages(budget=4, chunk_budget=9)},  # sparse, pages on the GPU
    {"offload": "all", "sparse": oomb.TopKPages(budget=4, chunk_budget=9)},  # sparse, gathered from the host
    {"offload": "all", "keep_attention": True},  # attention outputs kept on the host
], ids=["dense", "dense-all", "sparse", "sparse-all", "kept-host"])
def test_no_host_sync_per_chunk(wide_model, kwargs):
    """A step syncs the host a fixed number of times, however many chunks, pages and groups it
    has: a sync per chunk and layer drains the GPU's queue (e.g. `x[index] = 0` on a CUDA
    tensor copies the 0 from the host and syncs). (The host-lead throttle waits on an event,
    which the debug mode does not count: it leaves a chunk queued.)"""
    engine = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, page_size=128, **kwargs)
    sites = {}
    for length in (4096, 16384):
        ids = torch.randint(0, 152064, (1, length), device="cuda")
        engine.forward_backward(ids)  # warm-up at this size (allocations)
        wide_model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        sites[length] = sync_sites(engine, ids)
        wide_model.zero_grad(set_to_none=True)
    print(f"syncs per step {kwargs}: {len(sites[4096])} at 4K, {len(sites[16384])} at 16K: {Counter(sites[16384])}")
    # 16K: 12 more chunks, 8 pages more per layer and chunk, many more groups: no more syncs
    # than at 4K, and only the one at the start (the count of predicted tokens).
    assert len(sites[16384]) <= min(len(sites[4096]), 1), Counter(sites[16384])


def test_sparse_bf16_dense_budget_and_determinism(wide_model):
    """Sparse kernels in bf16: a budget covering every page is as close to the fp32 truth as
    dense bf16; with a small budget and chunk_budget, two runs and offload 'all' / 'auto'
    (pages gathered from the host by the zero-copy kernel) give torch.equal gradients."""
    ids = torch.randint(0, 152064, (1, 6000), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    fp32 = fp32_copy(wide_model)
    oomb.ChunkRecurrentEngine(fp32, chunk_size=1024, page_size=128).forward_backward(ids)
    truth = grads_of(fp32)
    del fp32
    oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, page_size=128).forward_backward(ids)
    g_dense = grads_of(wide_model)
    full = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, page_size=128,
                                     sparse=oomb.TopKPages(budget=40))  # 40 earlier pages at most
    full.forward_backward(ids)
    g_full = grads_of(wide_model)
    for n in truth:
        e_sparse, e_dense = rel_err(g_full[n], truth[n]), rel_err(g_dense[n], truth[n])
        assert e_sparse <= 3 * e_dense + 1e-3, f"{n}: sparse {e_sparse:.2e} vs dense {e_dense:.2e}"
    assert_offload_modes_identical(wide_model, ids, sparse=oomb.TopKPages(budget=4, chunk_budget=9))


def test_gpt_oss_bf16_matches_full_sequence():
    """A 2-layer GPT-OSS-20B-width model (sliding + full layer, sinks, MoE) in bf16 on the
    Triton kernels against transformers in fp32, within 3x transformers-bf16's own error."""
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=64, num_local_experts=8, num_experts_per_tok=4, sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2, vocab_size=201088)
    cfg._attn_implementation = "eager"
    with torch.device("cuda"):
        fp32 = GptOssForCausalLM(cfg).float()
    ids = torch.randint(0, cfg.vocab_size, (1, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    fp32(input_ids=ids, labels=ids).loss.backward()
    truth = grads_of(fp32)
    model = fp32.to(torch.bfloat16)
    model(input_ids=ids, labels=ids).loss.backward()
    hf = grads_of(model)
    oomb.ChunkRecurrentEngine(model, chunk_size=1024, page_size=128, backend="triton").forward_backward(ids)
    ours = grads_of(model)
    for n in truth:
        e_ours, e_hf = rel_err(ours[n], truth[n]), rel_err(hf[n], truth[n])
        assert e_ours <= 3 * e_hf + 1e-3, f"{n}: oomb {e_ours:.2e} vs transformers bf16 {e_hf:.2e}"


def test_liger_kernels_in_the_engine():
    """Liger's RMSNorm and SwiGLU patched into a model: the engine's loss and gradients stay
    within bf16 rounding of the unpatched model's, and other models keep transformers' modules."""
    pytest.importorskip("liger_kernel")
    from transformers.models.qwen2 import modeling_qwen2

    from oomb.models.liger import apply_liger
    from oomb.presets import load_model
    norm_class = modeling_qwen2.Qwen2RMSNorm
    ids = torch.randint(0, 152064, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    results = []
    for liger in (False, True):
        torch.manual_seed(0)
        model = load_model("qwen2.5-7b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=2).train()
        if liger:
            apply_liger(model)
            mlp = model.model.layers[0].mlp
            assert mlp._get_name() == "LigerSwiGLUMLP" and "forward" in vars(mlp)  # patched in place
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=1024, backend="triton")
        loss = engine.forward_backward(ids).loss
        results.append((float(loss), grads_of(model)))
        del engine, model
    assert modeling_qwen2.Qwen2RMSNorm is norm_class  # the module-level class was put back
    (loss0, g0), (loss1, g1) = results
    assert abs(loss0 - loss1) <= 1e-2 * abs(loss0)
    worst = max(g0, key=lambda n: rel_err(g1[n], g0[n]))
    assert rel_err(g1[worst], g0[worst]) <= 3e-2, worst


def test_compiled_layers_in_the_engine(wide_model):
    """compile_layers=True on the GPU (Inductor's Triton kernels, bf16): loss and gradients
    within bf16 rounding of the eager engine's; a second step reuses the compiled code."""
    ids = torch.randint(0, 152064, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    eager = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, backend="triton")
    loss0 = float(eager.forward_backward(ids).loss)
    g0 = grads_of(wide_model)
    compiled = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, backend="triton", compile_layers=True)
    for _ in range(2):
        loss1 = float(compiled.forward_backward(ids).loss)
        g1 = grads_of(wide_model)
        assert abs(loss0 - loss1) <= 1e-2 * abs(loss0)
        worst = max(g0, key=lambda n: rel_err(g1[n], g0[n]))
        assert rel_err(g1[worst], g0[worst]) <= 3e-2, worst


def test_float8_compiled_layers_on_the_gpu():
    """apply_float8 + compile_layers on an H200 (torchao's float8 GEMMs): compiling adds no error
    of its own. Float8 rounding moves small gradients far (compiled vs eager differ 27 % in a
    q_proj weight: the two round different bf16 inputs), so each float8 step is compared with the
    bf16 step: the compiled one no further from it than the eager one (1.5x + 0.02); the loss
    within 1 % of eager and 2 % of bf16."""
    pytest.importorskip("torchao.float8", reason="install the wheel: pip install --no-deps .whl/torchao-*.whl")
    from oomb.models.float8 import apply_float8
    from oomb.presets import load_model

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9+")
    torch.manual_seed(0)
    model = load_model("qwen2.5-7b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=2).train()
    ids = torch.randint(0, 152064, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    loss_bf16 = float(oomb.ChunkRecurrentEngine(model, chunk_size=1024, backend="triton").forward_backward(ids).loss)
    g_bf16 = grads_of(model)
    apply_float8(model)
    runs = []
    for compiled in (False, True):
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=1024, backend="triton", compile_layers=compiled)
        runs.append((float(engine.forward_backward(ids).loss), grads_of(model)))
    (loss_eager, g_eager), (loss_compiled, g_compiled) = runs
    assert abs(loss_compiled - loss_eager) <= 1e-2 * abs(loss_eager)
    assert abs(loss_compiled - loss_bf16) <= 2e-2 * abs(loss_bf16)
    errors = {n: (rel_err(g_eager[n], g_bf16[n]), rel_err(g_compiled[n], g_bf16[n])) for n in g_bf16}
    for n, (eager, compiled) in sorted(errors.items(), key=lambda item: -item[1][1]):
        print(f"{n}: float8 vs bf16 gradient, eager {eager:.3g}, compiled {compiled:.3g}")
    worst = max(errors, key=lambda n: errors[n][1] - 1.5 * errors[n][0])
    assert errors[worst][1] <= 1.5 * errors[worst][0] + 0.02, (worst, errors[worst])


def test_evaluation_only_engine_equals_training_engine(wide_model):
    """kv_grad_dtype=None (K/V pages only, here on the host): the same loss bitwise."""
    ids = torch.randint(0, 152064, (1, 6000), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    losses = [oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, offload="all", kv_grad_dtype=grads)
              .evaluate(ids).loss for grads in (torch.float32, None)]
    assert torch.equal(*losses)


def test_fp32_gradient_sums_on_the_gpu(wide_model):
    """param_grad_dtype=torch.float32 at 16 chunks of 7B width: within a bf16 rounding of exact
    (float64) sums of the same chunk gradients; the default bf16 sums further off."""
    ids = torch.randint(0, wide_model.config.vocab_size, (1, 8192), device="cuda")
    grads = {}
    for name, wide in (("exact", torch.float64), ("fp32", torch.float32), ("bf16", None)):
        oomb.ChunkRecurrentEngine(wide_model, chunk_size=512, backend="triton", param_grad_dtype=wide).forward_backward(ids)
        grads[name] = grads_of(wide_model)
    err = {k: max(rel_err(grads[k][n], grads["exact"][n]) for n in grads[k]) for k in ("fp32", "bf16")}
    assert err["fp32"] <= 2 ** -8 and err["bf16"] > 2 * err["fp32"], err


def test_adamw8bit_on_the_gpu():
    """torchao's AdamW8bit as the trainer makes it, on CUDA bf16 weights: the state the engine
    reserves for it is the state it allocates, and updates below half a bf16 step still move
    weights (stochastic rounding) where torch's AdamW leaves them."""
    pytest.importorskip("torchao", reason="install the wheel: pip install --no-deps .whl/torchao-*.whl")
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import make_optimizer, optimizer_state_bytes

    torch.manual_seed(0)
    w = (torch.randn(4096, 1024, device="cuda") * 0.02).bfloat16()
    big = w.abs() >= 512 * 1e-5
    moved = {}
    for name in ("adamw", "adamw8bit"):
        p = torch.nn.Parameter(w.clone())
        opt = make_optimizer([p], TrainConfig(optimizer=name, lr=1e-5))
        predicted = optimizer_state_bytes(opt)
        p.grad = torch.ones_like(p)
        before = torch.cuda.memory_allocated()
        opt.step()
        assert torch.cuda.memory_allocated() - before == pytest.approx(predicted, rel=0.01), name
        moved[name] = (p.detach() != w)[big].float().mean().item()
    assert moved["adamw"] == 0.0 and moved["adamw8bit"] > 0.02, moved


def test_kept_attention_when_it_fits_on_the_gpu(wide_model):
    """keep_attention=None keeps on the GPU when the outputs fit beside the pages, and on the host
    when the memory still to come (reserved_gpu_bytes: the optimizer state) leaves too little room
    for them: reserving all but the pages and 1.25x the outputs keeps them on the GPU, all but the
    pages and half the outputs on the host (within kept_host_bytes; none with 0)."""
    ids = torch.randint(0, wide_model.config.vocab_size, (1, 32768), device="cuda")
    for room, host_bytes, where in ((1.25, None, "gpu"), (0.5, 2**33, "host"), (0.5, 0, None)):
        engine = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, keep_attention=None,
                                           kept_host_bytes=host_bytes)
        pages = ids.shape[1] // engine.page_size
        need, kept = engine.store.device_bytes(1, pages), engine.memory.attention_bytes(1, pages)
        assert kept > 2**27, "the outputs must take enough room for the boundary to mean something"
        room_now = engine.memory.headroom(engine.config)
        engine.config = engine.config.replace(reserved_gpu_bytes=room_now - need - int(room * kept))
        engine.forward_backward(ids)
        assert engine.kept.where == where, (room, kept)
    wide_model.zero_grad(set_to_none=True)


def test_kept_attention_identical_on_the_gpu(wide_model):
    """keep_attention with the Triton kernels in bf16, kept on the GPU (offload 'none', and 'all'
    where they fit beside the staging buffers) and in pinned host memory (offload 'all' with the
    GPU's room reserved; 'auto' with every layer's pages on the host), dense and sparse: losses
    and gradients torch.equal keeping nothing."""
    ids = torch.randint(0, wide_model.config.vocab_size, (1, 8192), device="cuda")
    sparse = oomb.TopKPages(budget=4, chunk_budget=9)
    for extra in ({}, {"sparse": sparse}):
        runs = {}
        for name, kwargs in [("none", {"keep_attention": False}), ("gpu", {"keep_attention": True}),
                             ("gpu, all", {"keep_attention": True, "offload": "all"}),
                             ("host, all", {"keep_attention": True, "offload": "all", "reserved_gpu_bytes": 2**50}),
                             ("host, auto", {"keep_attention": None, "offload": "auto",
                                             "gpu_page_budget_bytes": 0, "reserved_gpu_bytes": 2**50})]:
            engine = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, backend="triton", **kwargs, **extra)
            runs[name] = (engine.forward_backward(ids).loss, grads_of(wide_model))
            assert engine.kept.layers == (() if name == "none" else (0,)), name
            assert engine.kept.where == (None if name == "none" else name.split(",")[0]), name
        loss0, g0 = runs["none"]
        for name, (loss, g) in runs.items():
            assert torch.equal(loss, loss0), (name, extra)
            assert all(torch.equal(g[n], g0[n]) for n in g0), (name, extra)


def test_dense_layers_and_evaluation_probes_on_the_gpu(wide_model):
    """Top-k with the last layer dense: offload modes bitwise equal in bf16. An evaluation with
    per-token losses and a selection-recall probe: the same with every page on the host as in the
    GPU pool (the probe reads host pages by copy), and the per-token mean is the loss."""
    from oomb.eval.selection_recall import RecallProbe
    ids = torch.randint(0, 152064, (1, 6000), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    assert_offload_modes_identical(wide_model, ids, sparse=oomb.TopKPages(budget=4, chunk_budget=9,
                                                                          dense_layers=(-1,)))
    runs = {}
    for offload in ("none", "all"):
        engine = oomb.ChunkRecurrentEngine(wide_model, chunk_size=1024, page_size=128, offload=offload,
                                           sparse=oomb.TopKPages(budget=4, chunk_budget=9), kv_grad_dtype=None)
        probe = RecallProbe({2, 4}, 2, 128, 128, engine.adapter.scale, seed=1)
        r = engine.evaluate(ids, per_token=True, probe=probe)
        runs[offload] = (r, probe.rows)
    (r, rows), (r_all, rows_all) = runs["none"], runs["all"]
    torch.testing.assert_close(r.token_losses, r_all.token_losses, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(r.predictions, r_all.predictions) and rows == rows_all and len(rows) == 2 * 2 * 2
    assert 0 < min(x["recall"] for x in rows) <= max(x["recall"] for x in rows) <= 1 + 1e-6
    assert abs(float(r.token_losses[:, 1:].mean()) - float(r.loss)) <= 1e-4 * float(r.loss)
