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


def ce_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of cross entropy over (N, V) logits (computed in fp32) and targets (N,) with
    IGNORE_INDEX, and the gradient of scale * that sum w.r.t. the logits, in their dtype:
    (softmax - one-hot) * scale on the counted rows. scale: a 0-dim tensor (a Python float
    would make torch.compile specialise on each value). Written as one function for
    torch.compile (compile_layers), which fuses it into a few passes over the logits where
    F.cross_entropy with autograd makes an fp32 copy, a softmax forward and a softmax
    backward: ~130 ms of a 64K-token 7B step on an H200 (H200, 2026-12-01, 88a73cb..6498886)."""
    x = logits.float()
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    ce = torch.where(valid, lse - picked, 0.0).sum()
    hot = torch.arange(x.shape[1], device=x.device)[None, :] == safe[:, None]
    weight = torch.where(valid, scale, 0.0)[:, None]
    return ce, ((torch.exp(x - lse[:, None]) - hot.float()) * weight).to(logits.dtype)


def head_loss(norm: nn.Module, lm_head: nn.Module, h: torch.Tensor, targets: torch.Tensor, step: int,
              denominator: int | None = None, fused_ce=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of cross entropy over a chunk's targets, `step` tokens per sequence at a time.

    h: (B, C, hidden) final hidden states of the chunk, before the final norm, outside any
    graph. targets: (B, C) with IGNORE_INDEX. With a `denominator`, each slice's
    sum(CE) / denominator is backpropagated into the norm parameters at once (so only one slice
    of logits ever exists) and dL/dh (B, C, hidden) is returned beside the sum. A trainable head
    (a plain nn.Linear) gets its weight gradient from one GEMM over the chunk, from each slice's
    logit gradient kept in the weight's dtype (B x C x vocab of it): per slice, a (vocab, hidden)
    gradient would be written and added into .grad once a slice. fused_ce: ce_and_grad (or its
    compiled form) for such a head's loss and logit gradient, instead of autograd through
    F.cross_entropy.
    Returns (sum of CE as a detached fp32 scalar, dL/dh or None).
    """
    backward = denominator is not None
    grad_h = torch.empty_like(h) if backward else None
    weight = head_weight(lm_head) if backward else None
    kept = None  # (dlogits, normed inputs) of every slice, for the head's weight gradient
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    fused = fused_ce is not None and weight is not None
    if fused:
        scale = torch.full((), 1.0 / denominator, dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[1], step):
        with torch.set_grad_enabled(backward):
            x = h[:, s : s + step].detach().requires_grad_(backward)
            xn = norm(x)
            if weight is None:
                out = lm_head(xn)
            else:
                out = F.linear(xn.detach(), weight.detach()).requires_grad_(not fused)
            if fused:
                ce, dlogits = fused_ce(out.flatten(0, 1), targets[:, s : s + step].flatten(), scale)
                dlogits = dlogits.view(out.shape)
            else:
                logits = out.float()  # (B, S, V) fp32, as transformers' loss upcasts
                ce = F.cross_entropy(logits.flatten(0, 1), targets[:, s : s + step].flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum")
        if weight is not None:
            if not fused:
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


@torch.no_grad()
def head_token_losses(norm: nn.Module, lm_head: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                      step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's cross entropy (fp32, NaN where the target is IGNORE_INDEX) and argmax
    prediction, (B, C) each, `step` tokens per sequence at a time (evaluation: no gradients)."""
    ce = torch.empty(targets.shape, dtype=torch.float32, device=h.device)
    pred = torch.empty(targets.shape, dtype=torch.long, device=h.device)
    for s in range(0, h.shape[1], step):
        logits = lm_head(norm(h[:, s : s + step])).float()  # (B, S, V)
        t = targets[:, s : s + step]
        loss = F.cross_entropy(logits.transpose(1, 2), t, ignore_index=IGNORE_INDEX, reduction="none")
        ce[:, s : s + step] = torch.where(t == IGNORE_INDEX, float("nan"), loss)
        pred[:, s : s + step] = logits.argmax(dim=-1)
    return ce, pred


def head_weight(lm_head: nn.Module) -> torch.Tensor | None:
    """The LM head's weight when head_loss computes its gradient itself: a trainable plain
    nn.Linear without bias (else autograd does, a slice at a time)."""
    if type(lm_head) is nn.Linear and lm_head.bias is None and lm_head.weight.requires_grad:
        return lm_head.weight
    return None
