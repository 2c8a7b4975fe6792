"""Mistral: the Llama decoder; config.sliding_window, when set, windows every layer (transformers
then masks the whole model with it), and oomb computes that window exactly, as GPT-OSS's."""
from .base import DecoderAdapter


class MistralAdapter(DecoderAdapter):
    model_classes = ("MistralForCausalLM",)
    rope_module = "transformers.models.mistral.modeling_mistral"
    supported_layer_types = ("full_attention", "sliding_attention")
    window_every_layer = True
