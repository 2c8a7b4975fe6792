"""Tiny random transformers models of every supported family, for exactness tests."""
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB = 97


def make_model(family: str, seed: int = 0, dtype=torch.float32, layers: int = 2, vocab: int = VOCAB):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096,
                  attention_dropout=0.0)
    if family == "qwen2":  # q/k/v biases, GQA 4:2... here 4 query heads per KV head
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                          tie_word_embeddings=False, **common)
        cls = Qwen2ForCausalLM
    elif family == "qwen2_tp":  # 4 query heads, 2 KV heads: splits over 2 ranks
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False, **common)
        cls = Qwen2ForCausalLM
    elif family == "llama":  # tied embeddings, llama3 RoPE scaling
        cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=True,
                          rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                           "rope_theta": 10000.0}, **common)
        cls = LlamaForCausalLM
    elif family == "qwen3":  # q/k norms, explicit head_dim != hidden / heads, GQA 7:1... 3 heads per KV head
        cfg = Qwen3Config(hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
                          head_dim=16, tie_word_embeddings=False, **common)
        cls = Qwen3ForCausalLM
    elif family == "gpt_oss":  # sliding (window 24) and full layers, sinks, 4 experts (top 2)
        cfg = GptOssConfig(hidden_size=48, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
                           layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                           tie_word_embeddings=False, **common)
        cls = GptOssForCausalLM
    elif family in ("mistral", "mistral_window"):  # explicit head_dim; a window of 24 on every layer, or none
        cfg = MistralConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, sliding_window=24 if family == "mistral_window" else None,
                            tie_word_embeddings=False, **common)
        cls = MistralForCausalLM
    elif family in ("phi3", "phi3_longrope"):  # fused qkv / gate_up, half of each head rotated, tied embeddings
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        if family == "phi3_longrope":  # LongRoPE: long factors past 64 positions (4 = rotated dims / 2)
            rope.update(rope_type="longrope", short_factor=[1.0, 1.1, 1.2, 1.5], long_factor=[1.0, 2.0, 4.0, 8.0])
        cfg = Phi3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters=rope, original_max_position_embeddings=64, tie_word_embeddings=True,
                         resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         **common)
        cls = Phi3ForCausalLM
    elif family == "qwen3_moe":  # q/k norms, 4 experts (top 2, renormalised); layer 1 a dense MLP
        cfg = Qwen3MoeConfig(hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                             norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False, **common)
        cls = Qwen3MoeForCausalLM
    elif family == "mixtral":  # 4 SwiGLU experts, top 2
        cfg = MixtralConfig(hidden_size=48, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                            tie_word_embeddings=False, **common)
        cls = MixtralForCausalLM
    elif family in ("gemma3", "gemma3_dynamic"):  # local (window 24) and global layers, each kind with its
        # RoPE (bases 10 and 1e4: a layer rotated by the other's differs at these lengths; the global one
        # linear-scaled as the published 4B-27B are, or dynamic NTK past 64 positions); q/k norms, sandwich
        # norms, scaled embeddings, attention scale 24**-0.5 (not head_dim 16's), tied embeddings
        if family == "gemma3_dynamic":
            full = {"rope_type": "dynamic", "factor": 4.0}
            common["max_position_embeddings"] = 64
        else:
            full = {"rope_type": "linear", "factor": 8.0}
        cfg = Gemma3TextConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                               layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                "full_attention": {**full, "rope_theta": 10000.0}},
                               tie_word_embeddings=True, **common)
        cls = Gemma3ForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    model = cls(cfg).to(dtype)
    # Random norm weights and biases, so a missed norm or bias changes the result.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def llama_with_rope(rope: dict, max_positions: int, layers: int = 2):
    """A Llama of `layers` layers whose RoPE is `rope` (rope_parameters less the base) for `max_positions`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=max_positions,
                      rope_parameters={**rope, "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def full_sequence_grads(model, input_ids, labels):
    """transformers' own full-sequence training: (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_grads_match(model, ref_grads: dict, tol: float) -> dict:
    """Every parameter's .grad against ref_grads {name: gradient} within relative error tol (the
    worst one named); the same parameters must have gradients. Returns the model's gradients."""
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys()
    errors = {n: rel_err(got[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: relative error {errors[worst]:.2e}"
    return got
