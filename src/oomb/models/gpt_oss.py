"""GPT-OSS: sliding-window layers alternate with full ones, every head has a learned sink
logit in its softmax denominator, and the MLP is a mixture of experts (transformers' own
router and experts modules run it)."""
from .base import DecoderAdapter
from .experts import RoutedExperts


class GptOssAdapter(RoutedExperts, DecoderAdapter):
    model_classes = ("GptOssForCausalLM",)
    rope_module = "transformers.models.gpt_oss.modeling_gpt_oss"
    supported_layer_types = ("full_attention", "sliding_attention")
    rope_types = ("yarn",)  # trained with YaRN: a larger factor extends it, another type would discard it

    def sinks(self, layer):
        return layer.self_attn.sinks  # (H,)

    def mlp(self, layer, x):
        out, _router_scores = layer.mlp(x)  # the router's aux loss is refused (experts.py)
        return out
