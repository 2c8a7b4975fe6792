"""What the mixture-of-experts families share: the model's own router and experts modules run the
MLP (top-k routing, data-dependent shapes: not compiled, not split by tensor parallelism), and the
router's auxiliary load-balancing loss is refused where transformers would add it.

The auxiliary loss (transformers' load_balancing_loss_func, added to the loss when
config.output_router_logits is set) is num_experts * sum_e f_e * P_e with f_e the fraction of
routed (token, layer) slots sent to expert e and P_e the mean router probability of e, both over
every token and layer of the batch. A product of two whole-batch means is not a sum of per-chunk
terms, and chunk-recurrent training sums per-chunk losses: computing it would need f from the
whole sequence before the first chunk's backward (one more pass over the routing). oomb does not
make that pass, so such configs are refused; with output_router_logits off (the published
Qwen3-MoE, Mixtral and GPT-OSS configs) transformers' training loss is the LM loss alone, which
oomb computes exactly.
"""
from __future__ import annotations


class RoutedExperts:
    """Mixin for a DecoderAdapter whose layers route tokens to experts (place it first)."""

    compilable = False  # the experts' routing makes data-dependent shapes
    tp_refusal = "its experts are not split"
    # LoRA on attention: the experts are 3-D parameters, not the nn.Linear modules LoRA adapts (PEFT
    # would reach some families' experts through the MLP names, others' not: one rule for all)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        self.check_router_loss()

    def check_trainable(self) -> None:
        super().check_trainable()
        self.check_router_loss()  # output_router_logits may have been set since the engine was made

    def check_router_loss(self) -> None:
        # transformers reads the coefficient off the model (copied from the config when it was made)
        coef = getattr(self.causal_lm, "router_aux_loss_coef", getattr(self.config, "router_aux_loss_coef", 0.0))
        if getattr(self.config, "output_router_logits", False) and coef:
            raise ValueError(
                f"config.output_router_logits=True with router_aux_loss_coef={coef}: transformers adds the router's "
                "load-balancing loss, a product of whole-batch means that chunk-recurrent training (a sum of "
                "per-chunk losses) does not compute; set output_router_logits=False (the published configs' "
                "value: the LM loss alone) or the model's router_aux_loss_coef to 0")
