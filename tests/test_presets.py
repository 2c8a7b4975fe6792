"""Presets of published shapes (random weights): parameter counts against the model cards'."""
import math

import pytest
import torch

from oomb.presets import load_model


def expert_count(model) -> tuple[int, int]:
    """(experts a layer, parameters of one expert) of a mixture of experts, summed over its layers."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    per_expert = sum(sum(p.numel() for p in m.parameters()) // m.num_experts for m in experts)
    return experts[0].num_experts, per_expert


@pytest.mark.parametrize("name,cls,total,active,window", [
    ("mistral-7b", "MistralForCausalLM", 7.25e9, None, None),
    ("phi-4-mini", "Phi3ForCausalLM", 3.84e9, None, None),
    ("phi-3-medium", "Phi3ForCausalLM", 13.96e9, None, None),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.5e9, 3.3e9, None),
    ("mixtral-8x7b", "MixtralForCausalLM", 46.7e9, 12.9e9, None),
    # Gemma 3 technical report, Table 1, the vision encoder left out: embedding + non-embedding parameters
    ("gemma-3-4b", "Gemma3ForCausalLM", 675e6 + 3209e6, None, 1024),
    ("gemma-3-12b", "Gemma3ForCausalLM", 1012e6 + 10759e6, None, 1024),
])
def test_parameter_counts(name, cls, total, active, window):
    """Built on the meta device: the total (and, for a mixture of experts, the parameters a token
    uses: all but the experts it is not routed to) within 0.5 % of the published figure; full
    attention as the benchmarks measure, or Gemma 3's windows on its local layers."""
    model = load_model(name, dtype=torch.bfloat16, device="meta")
    assert type(model).__name__ == cls
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - total) <= 0.005 * total, n
    if active is not None:
        n_experts, per_expert = expert_count(model)
        used = n - per_expert * (n_experts - model.config.num_experts_per_tok)
        assert abs(used - active) <= 0.02 * active, used
    assert model.config.sliding_window == window


def test_phi4_mini_rotates_three_quarters_of_each_head_with_longrope():
    """Phi-4-mini's RoPE as its checkpoint has it: 48 rotated pairs (128 x 0.75 / 2), a LongRoPE
    factor for each, 4,096 original positions scaled 32x (attention scale sqrt(1 + ln 32 / ln 4096))."""
    model = load_model("phi-4-mini", dtype=torch.bfloat16, device="meta", num_hidden_layers=1)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.numel() == 48
    assert rotary.rope_type == "longrope"
    rope = model.config.rope_parameters
    assert len(rope["long_factor"]) == len(rope["short_factor"]) == 48
    assert rope["original_max_position_embeddings"] * rope["factor"] == model.config.max_position_embeddings
    assert rotary.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_gemma3_layers_five_local_to_one_global():
    """Gemma 3's pattern: every sixth layer global (RoPE base 1e6, linear x8), the others local
    (window 1024, base 1e4); the attention scale is query_pre_attn_scalar's (256**-0.5 = head_dim's
    here)."""
    model = load_model("gemma-3-4b", dtype=torch.bfloat16, device="meta")
    types = model.config.layer_types
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    rope = model.config.rope_parameters
    assert rope["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert model.model.layers[0].self_attn.scaling == 256**-0.5
