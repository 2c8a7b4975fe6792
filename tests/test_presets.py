"""Presets of published shapes (random weights): parameter counts against the model cards'."""
import pytest
import torch

from oomb.presets import load_model


def expert_count(model) -> tuple[int, int]:
    """(experts a layer, parameters of one expert) of a mixture of experts, summed over its layers."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    per_expert = sum(sum(p.numel() for p in m.parameters()) // m.num_experts for m in experts)
    return experts[0].num_experts, per_expert


@pytest.mark.parametrize("name,cls,total,active", [
    ("mistral-7b", "MistralForCausalLM", 7.25e9, None),
    ("phi-4-mini", "Phi3ForCausalLM", 3.84e9, None),
    ("phi-3-medium", "Phi3ForCausalLM", 13.96e9, None),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.5e9, 3.3e9),
    ("mixtral-8x7b", "MixtralForCausalLM", 46.7e9, 12.9e9),
])
def test_parameter_counts(name, cls, total, active):
    """Built on the meta device: the total (and, for a mixture of experts, the parameters a token
    uses: all but the experts it is not routed to) within 0.5 % of the published figure."""
    model = load_model(name, dtype=torch.bfloat16, device="meta")
    assert type(model).__name__ == cls
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - total) <= 0.005 * total, n
    if active is not None:
        n_experts, per_expert = expert_count(model)
        used = n - per_expert * (n_experts - model.config.num_experts_per_tok)
        assert abs(used - active) <= 0.02 * active, used
    assert model.config.sliding_window is None  # full attention, as the benchmarks measure


def test_phi4_mini_rotates_three_quarters_of_each_head():
    model = load_model("phi-4-mini", dtype=torch.bfloat16, device="meta", num_hidden_layers=1)
    assert model.model.rotary_emb.inv_freq.numel() == 48  # 128 x 0.75 / 2
