"""Named model shapes built from configs with random weights (no download needed).

`tiny` is the embedded default of `oomb train`; the others are the shapes the benchmarks
measure. A local directory or hub id goes through transformers' `from_pretrained` instead.
"""
from __future__ import annotations

import copy
import os
import sys

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig, GptOssConfig,
                          MistralConfig, MixtralConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen3MoeConfig)

from .models.quiet import import_model_code
from .models.rope import apply_rope

# Gemma 3's two RoPEs, by layer type (transformers' rope_parameters of a Gemma3TextConfig)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}

# Phi-4-mini's LongRoPE (48 factors: one per rotated pair of 96 = 128 x 0.75 dimensions)
PHI4_MINI_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "factor": 32.0,
                  "original_max_position_embeddings": 4096,
                  "short_factor": [1.0] * 48,
                  "long_factor": [1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
                                  2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
                                  4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
                                  8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
                                  16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884,
                                  32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97,
                                  33.28, 33.49, 33.5, 44.16, 47.77]}

PRESETS = {
    # byte-level vocabulary; 2 layers (the fewest an induction head needs), 2 heads: learns oomb train's
    # default copy task in ~400 CPU steps of 1,024 tokens (docs/experiments.md, the demo's size)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=256, rope_theta=10000.0),
    # tiny with 32 key and 32 value ids above the bytes: the recall study's CPU smoke test (bench/quality.py)
    "tiny-kv": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=320, rope_theta=10000.0),
    # byte-level, Qwen2 shape, ~30M parameters, head_dim 128: the long-context quality study (bench/quality.py)
    "byte-lm-30m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=False),
    # byte-lm-30m with 256 key and 256 value ids above the bytes: the associative recall study (data/recall.py)
    "byte-kv-30m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=768, rope_theta=10000.0, tie_word_embeddings=False),
    # byte-kv-30m's vocabulary in a small model (hidden 256, head_dim 64, tied embeddings): the recall
    # study's race (bench/quality.py) asks whether fewer layers discover recall sooner
    "byte-kv-2l": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=768, rope_theta=10000.0, tie_word_embeddings=True),
    "byte-kv-4l": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=768, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    # GPT-OSS-20B: 24 layers alternating sliding-window (128) and full attention, sinks, 32 experts top-4
    "gpt-oss-20b": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        vocab_size=201088, sliding_window=128, tie_word_embeddings=False),
    # Mistral-7B v0.3: Llama shape with a 32768 vocabulary, no sliding window
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32768, rope_theta=1e6, rms_norm_eps=1e-5,
                       max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False),
    # Phi-4-mini (microsoft/Phi-4-mini-instruct's config): fused qkv/gate_up, 3/4 of each head rotated, tied
    # embeddings, LongRoPE from 4,096 to 131,072 positions (the long factors past 4,096); its sliding_window
    # (262,144) is past its positions, so full attention here
    "phi-4-mini": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                       num_key_value_heads=8, vocab_size=200064, rms_norm_eps=1e-5, max_position_embeddings=131072,
                       rope_parameters=PHI4_MINI_ROPE,
                       sliding_window=None, tie_word_embeddings=True),
    # Phi-3-medium (14B): the 4K checkpoint's shape; full attention (its config's window is 2047)
    "phi-3-medium": dict(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                         num_key_value_heads=10, vocab_size=32064, rms_norm_eps=1e-5, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=None,
                         tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 layers of 128 experts (width 768), 8 routed a token, q/k norms
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, rope_theta=1e6,
                          rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False),
    # Mixtral-8x7B: Mistral-7B's attention, 8 SwiGLU experts of width 14336, 2 routed a token
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None,
                         tie_word_embeddings=False),
    # Gemma 3 4B / 12B, the text model (Gemma3ForCausalLM; the published checkpoints add a vision
    # encoder): 5 sliding-window (1024) layers to each global one, local RoPE base 1e4, global 1e6
    # linear-scaled by 8, q/k norms, attention scale 256**-0.5, tied embeddings
    "gemma-3-4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, vocab_size=262208,
                       sliding_window=1024, max_position_embeddings=131072, rope_parameters=GEMMA3_ROPE,
                       tie_word_embeddings=True),
    "gemma-3-12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, vocab_size=262208,
                        sliding_window=1024, max_position_embeddings=131072, rope_parameters=GEMMA3_ROPE,
                        tie_word_embeddings=True),
}
_CONFIGS = {"gpt-oss-20b": GptOssConfig, "mistral-7b": MistralConfig, "phi-4-mini": Phi3Config,
            "phi-3-medium": Phi3Config, "qwen3-30b-a3b": Qwen3MoeConfig, "mixtral-8x7b": MixtralConfig,
            "gemma-3-4b": Gemma3TextConfig, "gemma-3-12b": Gemma3TextConfig}  # others: Qwen2


def preset_config(name: str, **overrides) -> PretrainedConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (or a local model directory)")
    config_class = _CONFIGS.get(name, Qwen2Config)
    if config_class is Qwen2Config:
        overrides = {"max_position_embeddings": 4_194_304, **overrides}
    elif config_class is GptOssConfig and "num_hidden_layers" in overrides:  # keep the sliding/full alternation
        overrides["layer_types"] = [("sliding_attention", "full_attention")[i % 2]
                                    for i in range(overrides["num_hidden_layers"])]
    return config_class(**copy.deepcopy({**PRESETS[name], **overrides}))  # its dicts (RoPE) the config's own


def _checkpoint_name(name_or_path: str) -> bool:
    """A local directory or an org/name hub id: a bare name that is neither never reaches the hub
    (offline, transformers retries it for ~45 s before failing)."""
    return "/" in name_or_path or os.path.isdir(name_or_path)


def load_config(name_or_path: str, rope_theta: float | None = None, rope_scaling: str | None = None,
                **overrides) -> PretrainedConfig:
    """A preset's config or a local checkpoint's, with RoPE extended as asked (models/rope.py); of
    what a run wrote (an adapter, an older oomb's step-N: train/export.py), its base's. Of a
    multimodal Gemma 3 checkpoint (Gemma3Config), its text model's (text_config)."""
    return _load_config(name_or_path, rope_theta, rope_scaling, **overrides)[0]


_NOTICED: set[str] = set()  # multimodal checkpoints whose notice was printed


def _text_of(cfg: PretrainedConfig, name_or_path: str, overrides: dict) -> PretrainedConfig:
    """A multimodal Gemma 3 config's text_config (with the overrides), after a one-line notice."""
    if name_or_path not in _NOTICED:
        _NOTICED.add(name_or_path)
        print(f"oomb: {name_or_path} is a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration): "
              f"its text model (Gemma3ForCausalLM) is loaded; the vision encoder is neither trained nor kept",
              file=sys.stderr, flush=True)
    text = copy.deepcopy(cfg.text_config)
    for key, value in overrides.items():
        setattr(text, key, value)
    return text


def _load_config(name_or_path: str, rope_theta: float | None = None, rope_scaling: str | None = None,
                 **overrides) -> tuple[PretrainedConfig, PretrainedConfig | None]:
    """load_config's config and, for a multimodal Gemma 3 checkpoint, its full config (else None)."""
    from .train.export import describe

    multimodal = None
    if name_or_path in PRESETS:
        cfg = preset_config(name_or_path, **overrides)
    elif (artefact := describe(name_or_path)) is not None and artefact.base is not None:
        return _load_config(artefact.base.model, artefact.base.rope_theta if rope_theta is None else rope_theta,
                            rope_scaling or artefact.base.rope_scaling or None, **overrides)
    else:
        if not _checkpoint_name(name_or_path):
            raise ValueError(f"--model {name_or_path!r} is neither a preset nor a local checkpoint directory; "
                             f"presets: {', '.join(PRESETS)}")
        try:
            cfg = AutoConfig.from_pretrained(name_or_path, **overrides)
        except (OSError, ValueError) as e:
            where = "a local directory without a usable config.json" if os.path.isdir(name_or_path) else \
                "neither a preset nor a local checkpoint directory, and not reachable as a hub id"
            raise ValueError(f"--model {name_or_path!r} is {where}; presets: {', '.join(PRESETS)} ({e})") from None
        if isinstance(cfg, Gemma3Config):  # Gemma 3 4B-27B: the text model of the multimodal checkpoint
            multimodal, cfg = cfg, _text_of(cfg, name_or_path, overrides)
    apply_rope(cfg, rope_theta, rope_scaling)
    return cfg, multimodal


def load_tokenizer(name_or_path: str):
    """A checkpoint's tokenizer: a local directory or an org/name hub id. A preset (random weights,
    no tokenizer) and a bare name that is no directory are refused at once (_checkpoint_name)."""
    from transformers import AutoTokenizer

    if name_or_path in PRESETS:
        raise ValueError(f"{name_or_path!r} is a preset: random weights and no tokenizer")
    if not _checkpoint_name(name_or_path):
        raise ValueError(f"{name_or_path!r} is neither a local checkpoint directory nor an org/name hub id")
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{name_or_path!r} has no tokenizer transformers can load ({e})") from None


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               rope_theta: float | None = None, rope_scaling: str | None = None, **overrides):
    """A preset with random weights, a transformers checkpoint (local directory), or what a run
    wrote (a LoRA adapter merged into its base, an older oomb's step-N: train/export.py); RoPE
    extended by rope_theta / rope_scaling (models/rope.py)."""
    from .train.export import describe, load

    if name_or_path not in PRESETS and (artefact := describe(name_or_path)) is not None:
        if artefact.base is not None:
            return load(artefact, dtype, device, rope_theta, rope_scaling)
        artefact.verify()  # a step-N's files against its manifest
    cfg, multimodal = _load_config(name_or_path, rope_theta, rope_scaling, **overrides)
    import_model_code()
    if name_or_path in PRESETS:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    elif multimodal is not None:
        model = _gemma3_text_model(name_or_path, multimodal, cfg, dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, config=cfg, dtype=dtype).to(device)
    model.config.use_cache = False
    return model


def _gemma3_text_model(name_or_path: str, multimodal: Gemma3Config, text: Gemma3TextConfig, dtype):
    """The Gemma3ForCausalLM of a multimodal Gemma 3 checkpoint: transformers loads the whole
    Gemma3ForConditionalGeneration (its own key renames cover the checkpoint layouts, `language_model.model.*`
    and `model.language_model.*`), and its language model and LM head move into a Gemma3ForCausalLM
    of `text`; the vision tower and projector are dropped. (Gemma3ForCausalLM.from_pretrained of such a
    directory finds none of its keys and leaves every weight random.)"""
    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    multimodal = copy.deepcopy(multimodal)
    multimodal.text_config = text  # the RoPE and overrides load_config applied
    full = Gemma3ForConditionalGeneration.from_pretrained(name_or_path, config=multimodal, dtype=dtype)
    with torch.device("meta"):
        model = Gemma3ForCausalLM(text)
    model.model, model.lm_head = full.model.language_model, full.lm_head
    model.config = model.model.config
    del full
    return model
