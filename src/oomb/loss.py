"""LM head + cross entropy of one chunk, a slice of tokens at a time.

Only one slice's `[slice, vocab]` fp32 logits (and their gradient) exist at once: each slice
is run forward and backward on its own, its gradient w.r.t. the final hidden states written
into a buffer, and the chunk's body is then backpropagated once from that buffer. The head's
weight gradient is one GEMM over the chunk's kept logit gradients (in the weight's dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
#: fp32 logits of one slice stay under this many bytes (vocab 152K -> 441 tokens a slice)
SLICE_LOGIT_BYTES = 256 * 2**20


def slice_tokens(vocab_size: int, batch: int) -> int:
    """Tokens per sequence in one slice so that fp32 logits fit SLICE_LOGIT_BYTES."""
    return max(1, SLICE_LOGIT_BYTES // (4 * vocab_size * batch))


def shifted_targets(labels: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Targets of positions start..end-1: labels start+1..end (the next chunk's first label
    for the last position), IGNORE_INDEX past the sequence's end. (B, end - start)."""
    t = labels[:, start + 1 : end + 1]
    missing = (end - start) - t.shape[1]
    return F.pad(t, (0, missing), value=IGNORE_INDEX) if missing else t


def head_loss(norm: nn.Module, lm_head: nn.Module, h: torch.Tensor, targets: torch.Tensor, step: int,
              denominator: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of cross entropy over a chunk's targets, `step` tokens per sequence at a time.

    h: (B, C, hidden) final hidden states of the chunk, before the final norm, outside any
    graph. targets: (B, C) with IGNORE_INDEX. With a `denominator`, each slice's
    sum(CE) / denominator is backpropagated into the norm parameters at once (so only one slice
    of logits ever exists) and dL/dh (B, C, hidden) is returned beside the sum. A trainable head
    (a plain nn.Linear) gets its weight gradient from one GEMM over the chunk, from each slice's
    logit gradient kept in the weight's dtype (B x C x vocab of it): per slice, a (vocab, hidden)
    gradient would be written and added into .grad once a slice.
    Returns (sum of CE as a detached fp32 scalar, dL/dh or None).
    """
    backward = denominator is not None
    grad_h = torch.empty_like(h) if backward else None
    weight = head_weight(lm_head) if backward else None
    kept = None  # (dlogits, normed inputs) of every slice, for the head's weight gradient
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[1], step):
        with torch.set_grad_enabled(backward):
            x = h[:, s : s + step].detach().requires_grad_(backward)
            xn = norm(x)
            if weight is None:
                out = lm_head(xn)
            else:
                out = F.linear(xn.detach(), weight.detach()).requires_grad_()
            logits = out.float()  # (B, S, V) fp32, as transformers' loss upcasts
            ce = F.cross_entropy(logits.flatten(0, 1), targets[:, s : s + step].flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        if weight is not None:
            (dlogits,) = torch.autograd.grad(ce / denominator, out)  # what the linear's backward receives
            if kept is None:
                kept = (torch.empty((*h.shape[:2], weight.shape[0]), dtype=dlogits.dtype, device=h.device),
                        torch.empty((*h.shape[:2], weight.shape[1]), dtype=xn.dtype, device=h.device))
            kept[0][:, s : s + step] = dlogits
            kept[1][:, s : s + step] = xn.detach()
            xn.backward(dlogits @ weight.detach())
        elif backward:
            (ce / denominator).backward()
        if backward:
            grad_h[:, s : s + step] = x.grad
        total += ce.detach()
    if kept is not None:  # into .grad through autograd (its hooks run: the engine's fp32 sums)
        weight.backward(kept[0].flatten(0, 1).t() @ kept[1].flatten(0, 1))
    return total, grad_h


def head_weight(lm_head: nn.Module) -> torch.Tensor | None:
    """The LM head's weight when head_loss computes its gradient itself: a trainable plain
    nn.Linear without bias (else autograd does, a slice at a time)."""
    if type(lm_head) is nn.Linear and lm_head.bias is None and lm_head.weight.requires_grad:
        return lm_head.weight
    return None
