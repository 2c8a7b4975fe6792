"""LM head + cross entropy of one chunk, a slice of tokens at a time.

Only one slice's `[slice, vocab]` fp32 logits (and their gradient) exist at once: each slice
is run forward and backward on its own, its gradient w.r.t. the final hidden states written
into a buffer, and the chunk's body is then backpropagated once from that buffer.
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
    sum(CE) / denominator is backpropagated into the norm and head parameters at once (so only
    one slice of logits ever exists) and dL/dh (B, C, hidden) is returned beside the sum.
    Returns (sum of CE as a detached fp32 scalar, dL/dh or None).
    """
    backward = denominator is not None
    grad_h = torch.empty_like(h) if backward else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[1], step):
        with torch.set_grad_enabled(backward):
            x = h[:, s : s + step].detach().requires_grad_(backward)
            logits = lm_head(norm(x)).float()  # (B, S, V) fp32, as transformers' loss upcasts
            ce = F.cross_entropy(logits.flatten(0, 1), targets[:, s : s + step].flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
        if backward:
            (ce / denominator).backward()
            grad_h[:, s : s + step] = x.grad
        total += ce.detach()
    return total, grad_h
