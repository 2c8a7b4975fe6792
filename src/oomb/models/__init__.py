"""Model adapters: one file per transformers family."""
from __future__ import annotations

from torch import nn

from .base import DecoderAdapter
from .gemma3 import Gemma3Adapter
from .gpt_oss import GptOssAdapter
from .llama import LlamaAdapter
from .mistral import MistralAdapter
from .mixtral import MixtralAdapter
from .phi3 import Phi3Adapter
from .qwen2 import Qwen2Adapter
from .qwen3 import Qwen3Adapter
from .qwen3_moe import Qwen3MoeAdapter
from .quiet import import_model_code

ADAPTERS: dict[str, type[DecoderAdapter]] = {
    name: cls
    for cls in (Qwen2Adapter, LlamaAdapter, Qwen3Adapter, GptOssAdapter, MistralAdapter, Phi3Adapter, Qwen3MoeAdapter,
                MixtralAdapter, Gemma3Adapter)
    for name in cls.model_classes
}

#: transformers model classes oomb refuses for a reason of their own (not only for want of an adapter)
REFUSED: dict[str, str] = {
    "Gemma2ForCausalLM": "Gemma 2 soft-caps its attention logits (tanh, config.attn_logit_softcapping) in every "
                         "layer, and oomb's attention kernels have no soft-capping, forward or backward. Gemma 3 "
                         "(Gemma3ForCausalLM), which does not soft-cap, is supported",
    "Gemma3ForConditionalGeneration": "it is Gemma 3 with its vision encoder (what AutoModelForCausalLM makes of "
                                      "the 4B-27B checkpoints); oomb trains the text model, Gemma3ForCausalLM",
}


def _unsupported(name: str, hint: str = "") -> TypeError:
    """The error for a model class without an adapter: REFUSED's reason, or the supported classes."""
    if name in REFUSED:
        return TypeError(f"{name} is not supported by oomb: {REFUSED[name]}")
    return TypeError(f"{name} is not supported by oomb; supported model classes: {', '.join(sorted(ADAPTERS))}{hint}")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (its LoRA layers stay in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def adapter_class(config, name: str = "") -> type[DecoderAdapter]:
    """The adapter of a transformers config (or of the CausalLM class `name`), before any model exists."""
    if not name:
        from transformers import AutoModelForCausalLM

        archs = getattr(config, "architectures", None) or []
        name = next((a for a in archs if a in ADAPTERS), "")
        if not name:
            import_model_code()  # the mapping imports the family's model code
            mapped = AutoModelForCausalLM._model_mapping.get(type(config), None)
            name = mapped.__name__ if mapped is not None else type(config).__name__
    if name not in ADAPTERS:
        raise _unsupported(name)
    return ADAPTERS[name]


def adapter_for(model: nn.Module) -> DecoderAdapter:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers causal LM (torch.nn.Module), got {type(model).__name__}")
    causal_lm = unwrap_peft(model)
    name = type(causal_lm).__name__
    if name not in ADAPTERS:
        raise _unsupported(name, " (also when wrapped by PEFT). Load the model with AutoModelForCausalLM.")
    return ADAPTERS[name](causal_lm)
