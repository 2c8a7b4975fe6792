"""Mistral, Phi-3, Qwen3-MoE, Mixtral and Gemma 3: chunk-recurrent training equals transformers'."""
import pytest
import torch
from torch import nn

import oomb
from oomb.models import adapter_class
from test_engine import TOL, check_against_full_sequence
from test_packing import check_packed, packed_batch
from tiny_models import VOCAB, full_sequence_grads, make_model, rel_err

# mistral_window: a window of 24 on every layer (< chunk 32: reaches into the chunk before);
# phi3_longrope: long factors (the sequences pass its 64 original positions) on half of each head;
# gemma3: a local layer (window 24, RoPE base 10) and a global one (base 1e4, linear x8), q/k and
# sandwich norms, scaled embeddings, attention scale 24**-0.5 (head_dim 16)
FAMILIES = ["mistral", "mistral_window", "phi3", "phi3_longrope", "qwen3_moe", "mixtral", "gemma3"]


def batch(seq_len=150, rows=2, seed=4):
    ids = torch.randint(0, VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[-1, 20:40] = -100
    return ids, labels


OFFLOAD = {"offload": "all", "group_pages": 2}
TOP_K_ALL = {"sparse": oomb.TopKPages(budget=16, block_queries=16)}  # the budget covers every page: dense


@pytest.mark.parametrize("family,kwargs", [pytest.param(f, {}, id=f"{f}-dense") for f in FAMILIES] + [
    pytest.param(f, OFFLOAD, id=f"{f}-offload-all")
    for f in ("mistral_window", "phi3_longrope", "mixtral", "gemma3")] + [
    pytest.param(f, TOP_K_ALL, id=f"{f}-top-k") for f in ("mistral", "phi3", "qwen3_moe", "gemma3")] + [
    pytest.param("mistral_window", {"chunk_size": 16}, id="mistral_window-chunk-16"),  # window 24 > chunk
])
def test_equals_full_sequence(family, kwargs):
    check_against_full_sequence(make_model(family), *batch(), **{"chunk_size": 32, "page_size": 16,
                                                                 "backend": "torch", **kwargs})


@pytest.mark.parametrize("family", ["mistral_window", "phi3_longrope", "gemma3"])
def test_triton_equals_full_sequence(family):
    """The Triton kernels (interpreted on CPU, float32): window masks, partial rotary, Gemma 3's
    attention scale (the experts' MLP runs outside the kernels, as GPT-OSS's does in
    tests/test_gpt_oss.py)."""
    check_against_full_sequence(make_model(family), *batch(96, rows=1), chunk_size=32, page_size=16,
                                backend="triton", group_pages=2)


@pytest.mark.parametrize("family", ["mistral_window", "phi3_longrope", "qwen3_moe", "mixtral", "gemma3",
                                    "gemma3_dynamic"])
def test_packed_equals_documents_alone(family):
    """Each document rotated by its own positions (LongRoPE, and Gemma 3's global layers under dynamic
    NTK: by its own length) and windowed within itself."""
    check_packed(make_model(family), *packed_batch(), chunk_size=32, page_size=16, backend="torch")


def test_sliding_window_is_honoured_on_every_layer():
    """Mistral's config.sliding_window windows every layer: window 8 < page 16 keeps one page a
    chunk per layer (none goes to the host), the memory plan counts those pages, and the
    gradients equal transformers' (whose mask the window changes)."""
    from oomb.plan import plan
    model = make_model("mistral_window")
    model.config.sliding_window = 8
    ids, labels = batch()
    ref_loss, ref = full_sequence_grads(model, ids, labels)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch", offload="all")
    assert rel_err(engine.forward_backward(ids, labels).loss, ref_loss) <= TOL
    assert all(rel_err(p.grad, ref[n]) <= TOL for n, p in model.named_parameters())
    assert engine.store.tail_pages == {0: 1, 1: 1} and engine.store.host.layers == []
    p = plan(model.config, 150, batch=2, chunk_size=32, page_size=16, dtype=torch.float32)
    assert p.full_layers == 0 and p.window_pages == 2 * 4 * 2 * engine.store.spec.page_bytes  # layers x chunks x rows


def test_lora_targets():
    """The adapter's LoRA targets: every nn.Linear of a dense family's decoder layers (Phi-3's
    fused qkv_proj and gate_up_proj included), the attention projections of a mixture of experts
    (its experts are 3-D parameters; Qwen3-MoE's dense MLP layers are left alike); LoRA gradients
    through oomb equal transformers'; oomb plan's count of LoRA parameters is PEFT's."""
    import peft

    from oomb.plan import lora_params
    for family in ("qwen2", "mistral", "phi3", "qwen3_moe", "mixtral", "gemma3"):
        model = make_model(family)
        linears = {n for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)}
        if family in ("qwen3_moe", "mixtral"):
            linears = {n for n in linears if ".self_attn." in n}
        targets = list(adapter_class(model.config).lora_targets)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          init_lora_weights=False))
        adapted = {n.removeprefix("base_model.model.model.layers.") for n, m in lora.named_modules()
                   if hasattr(m, "lora_A")}
        assert len(linears) >= 8 and adapted == linears, (family, linears ^ adapted)
        # what `oomb plan --lora-rank` counts (its memory and the auto configuration) is what PEFT trains
        assert lora_params(model.config, 4) == sum(p.numel() for p in lora.parameters() if p.requires_grad), family
        if family in ("phi3", "mixtral"):
            check_against_full_sequence(lora, *batch(96, rows=1), chunk_size=32, page_size=16, backend="torch")


def test_phi3_residual_dropout_recompute_is_consistent():
    """resid_pdrop: the model's own Dropout modules run on both residual branches; stage 2 must
    redraw stage 1's masks. Layer 1's qkv_proj sees layer 0's dropped residuals: recorded per
    call, each chunk's two outputs match, and differ from those without dropout."""
    model = make_model("phi3")
    model.train()
    qkv = model.model.layers[1].self_attn.qkv_proj
    outputs = []
    qkv.register_forward_hook(lambda mod, inp, out: outputs.append(out.detach().clone()))
    ids = batch(130, rows=1)[0]  # 5 chunks
    for p in (0.3, 0.0):
        for layer in model.model.layers:
            layer.resid_attn_dropout.p = layer.resid_mlp_dropout.p = p
        oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch").forward_backward(ids)
    dropped, plain = outputs[:9], outputs[9:]
    for c in range(4):
        assert torch.equal(dropped[c], dropped[8 - c]), f"chunk {c} recomputed with other dropout masks"
        assert not torch.equal(dropped[c], plain[c])


@pytest.mark.parametrize("family", ["mistral_window", "phi3_longrope", "qwen3_moe", "gemma3"])
def test_export_loads_with_from_pretrained(family, tmp_path):
    """A step through oomb, then the export: transformers loads the same weights and config
    (sliding window, LongRoPE, experts, Gemma 3's layer types and RoPEs)."""
    from transformers import AutoModelForCausalLM

    from oomb.train.checkpoint import export
    model = make_model(family)
    oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch").forward_backward(batch()[0])
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
    loaded = AutoModelForCausalLM.from_pretrained(export(tmp_path, model, source="random"))
    assert type(loaded) is type(model)
    assert loaded.config.sliding_window == model.config.sliding_window
    assert loaded.config.rope_parameters == model.config.rope_parameters
    assert getattr(loaded.config, "layer_types", None) == getattr(model.config, "layer_types", None)
    got = dict(loaded.named_parameters())
    assert got.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(got[n], p) for n, p in model.named_parameters())


def test_tensor_parallel_refused_where_not_split():
    """Fused q/k/v (Phi-3) and experts are refused by name, by the planner and by the splitter;
    Mistral's separate projections split as Llama's do."""
    from oomb.parallel import apply_tensor_parallel
    from oomb.plan import plan

    class Mesh:
        def size(self):
            return 2
    for family, reason in (("phi3", "fused qkv_proj"), ("qwen3_moe", "experts"), ("mixtral", "experts")):
        model = make_model(family)
        name = type(model).__name__
        with pytest.raises(ValueError, match=rf"tp=2: tensor parallelism is not implemented for {name} .*{reason}"):
            plan(model.config, 1024, tp=2)
        with pytest.raises(ValueError, match=rf"not implemented for {name} .*{reason}.*--tp 1"):
            apply_tensor_parallel(model, Mesh())
    full = plan(make_model("mistral").config, 1024, tp=1)
    assert plan(make_model("mistral").config, 1024, tp=2).kv_pages == full.kv_pages // 2


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_aux_loss_refused(family):
    """output_router_logits makes transformers add router_aux_loss_coef x the load-balancing loss,
    which oomb does not compute: refused by name; a zero coefficient adds nothing and is accepted."""
    model = make_model(family)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"output_router_logits=True"):  # set after the engine was made
        engine.forward_backward(batch(96, rows=1)[0])
    with pytest.raises(ValueError, match=r"output_router_logits=True with router_aux_loss_coef=0.001"):
        oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16)
    model.router_aux_loss_coef = 0.0  # transformers reads it off the model
    if family == "qwen3_moe":  # the same code path in both families: one exactness check
        check_against_full_sequence(model, *batch(96, rows=1), chunk_size=32, page_size=16, backend="torch")
    else:
        oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16)  # accepted


def test_rope_scaling_refused_for_phi3():
    """Phi3Config accepts default and LongRoPE only: --rope-scaling is refused before a model is built."""
    from oomb.models.rope import apply_rope
    config = make_model("phi3").config
    with pytest.raises(ValueError, match=r"Phi3ForCausalLM supports no RoPE scaling"):
        apply_rope(config, scaling="yarn:4")


def test_gemma3_windows_its_local_layers_only():
    """Gemma 3's config.layer_types: its local layers (window 24) keep the 2 pages a chunk their
    window reaches, on the GPU, its global layers every page (on the host with offload 'all'); the
    memory plan counts them alike; gradients equal transformers' with 2 layers of each RoPE."""
    from oomb.plan import plan
    model = make_model("gemma3", layers=4)  # local, global, local, global
    ids, labels = batch()
    ref_loss, ref = full_sequence_grads(model, ids, labels)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch", offload="all")
    assert rel_err(engine.forward_backward(ids, labels).loss, ref_loss) <= TOL
    assert all(rel_err(p.grad, ref[n]) <= TOL for n, p in model.named_parameters())
    assert engine.store.tail_pages == {0: 2, 2: 2} and engine.store.host.layers == [1, 3]
    p = plan(model.config, 150, batch=2, chunk_size=32, page_size=16, dtype=torch.float32)
    page = engine.store.spec.page_bytes
    assert p.full_layers == 2 and p.window_pages == 2 * 4 * 2 * 2 * page  # layers x chunks x pages x rows


@pytest.mark.parametrize("field,value,match", [
    ("attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50.0: oomb's attention kernels have no soft-capping"),
    ("final_logit_softcapping", 30.0, r"final_logit_softcapping=30.0: oomb's loss .* no soft-capping; set it to None"),
    ("use_bidirectional_attention", True, r"use_bidirectional_attention=True: oomb's attention is causal"),
])
def test_gemma3_refuses_what_oomb_does_not_compute(field, value, match):
    model = make_model("gemma3")
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=rf"config.{match}"):
        oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16)


def test_gemma2_refused_for_its_soft_capping():
    """Gemma 2 soft-caps every attention logit, which the kernels do not compute: refused with that
    reason (not as an unknown class), by the engine and by the memory plan."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from oomb.plan import plan
    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=VOCAB)
    why = r"Gemma2ForCausalLM is not supported by oomb: Gemma 2 soft-caps its attention logits .* no soft-capping"
    with pytest.raises(TypeError, match=why):
        oomb.ChunkRecurrentEngine(Gemma2ForCausalLM(config))
    with pytest.raises(TypeError, match=why):
        plan(config, 1024)


def test_multimodal_gemma3_refused_naming_the_text_model():
    from transformers import Gemma3Config

    with pytest.raises(TypeError, match=r"Gemma3ForConditionalGeneration is not supported by oomb: .* vision encoder"
                                        r".* oomb trains the text model, Gemma3ForCausalLM"):
        adapter_class(Gemma3Config())


def multimodal_gemma3_config():
    """A tiny Gemma3Config: a local and a global text layer, a one-layer SigLIP of 2x2 patches."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, vocab_size=300, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        boi_token_index=297, eoi_token_index=298, image_token_index=299)


def save_multimodal_gemma3(path, layout="as saved"):
    """A tiny Gemma3ForConditionalGeneration saved in `path`; layout "model.language_model": its keys
    renamed to the other published layout (transformers 4.52+'s saves) from transformers' own."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3ForConditionalGeneration

    config = multimodal_gemma3_config()
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    if layout == "model.language_model":
        weights = load_file(path / "model.safetensors")
        assert any(k.startswith("language_model.model.") for k in weights)
        renamed = {k.replace("language_model.model.", "model.language_model.", 1) if k.startswith("language_model.")
                   else f"model.{k}": v for k, v in weights.items()}
        save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("layout", ["as saved", "model.language_model"])
def test_multimodal_gemma3_checkpoint_loads_its_text_model(layout, tmp_path, capsys):
    """--model of a multimodal Gemma 3 directory: its text model, Gemma3ForCausalLM with the language
    model's weights (the multimodal model's text-only logits), the vision encoder left out, with a notice."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from oomb.presets import load_config, load_model
    multimodal = save_multimodal_gemma3(tmp_path, layout)
    model = load_model(str(tmp_path)).eval()
    assert type(model) is Gemma3ForCausalLM and type(model.config) is Gemma3TextConfig
    assert isinstance(load_config(str(tmp_path)), Gemma3TextConfig)
    assert not any("vision" in name or "multi_modal" in name for name, _ in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the checkpoint
    notice = capsys.readouterr().err
    assert notice.count("multimodal Gemma 3 checkpoint") == 1 and "vision encoder is neither trained nor kept" in notice
    ids = torch.randint(0, 297, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, multimodal(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_multimodal_gemma3_checkpoint_plans_and_trains(tmp_path, capsys):
    from oomb.cli import main
    save_multimodal_gemma3(tmp_path / "gemma3")
    main(["plan", "--model", str(tmp_path / "gemma3"), "--seq-len", "1K"])
    assert "multimodal Gemma 3 checkpoint" in capsys.readouterr().err
    main(["train", "--model", str(tmp_path / "gemma3"), "--steps", "1", "--seq-len", "64", "--chunk-size", "32",
          "--page-size", "16", "--backend", "torch", "--device", "cpu", "--output-dir", str(tmp_path / "out")])
    assert "step     1/1  loss" in capsys.readouterr().out


def test_multimodal_gemma3_model_object_refused():
    """The Gemma3ForConditionalGeneration object itself (vision encoder and all) is not taken by the engine."""
    from transformers import Gemma3ForConditionalGeneration

    with pytest.raises(TypeError, match=r"Gemma3ForConditionalGeneration is not supported by oomb: .* vision encoder"):
        oomb.ChunkRecurrentEngine(Gemma3ForConditionalGeneration(multimodal_gemma3_config()))
