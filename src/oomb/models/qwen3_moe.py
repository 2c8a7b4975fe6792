"""Qwen3-MoE: Qwen3's attention (q/k norms) with a top-k mixture of experts in every layer but
config.mlp_only_layers (a dense MLP there; the model's own modules run either), and
config.sliding_window on every layer when use_sliding_window is set."""
from .experts import RoutedExperts
from .qwen3 import Qwen3Adapter


class Qwen3MoeAdapter(RoutedExperts, Qwen3Adapter):
    model_classes = ("Qwen3MoeForCausalLM",)
    rope_module = "transformers.models.qwen3_moe.modeling_qwen3_moe"
    supported_layer_types = ("full_attention", "sliding_attention")
    window_every_layer = True
