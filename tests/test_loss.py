"""loss.py: the LM head's cross entropy a slice of tokens at a time, and its fused gradient."""
import pytest
import torch
import torch.nn.functional as F

from tiny_models import rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_equals_autograd(dtype):
    """loss.ce_and_grad (the head's loss under compile_layers) gives F.cross_entropy's sum and
    the gradient autograd gives for sum / denominator, ignored targets included."""
    from oomb.loss import IGNORE_INDEX, ce_and_grad
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(37, 301, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (37,), generator=gen)
    targets[[0, 5, 36]] = IGNORE_INDEX
    ce = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (grad,) = torch.autograd.grad(ce / 123, logits)
    fused_ce, fused_grad = ce_and_grad(logits.detach(), targets, torch.tensor(1 / 123))
    assert fused_grad.dtype == dtype and fused_grad[[0, 5, 36]].abs().max() == 0
    assert rel_err(fused_ce, ce) <= 1e-6
    assert rel_err(fused_grad.float(), grad.float()) <= (1e-6 if dtype == torch.float32 else 1e-2)
