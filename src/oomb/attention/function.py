"""The autograd Function of paged attention, over groups of pages, for every backend.

A layer's earlier pages are attended a group at a time (a fixed number of pages: the unit
that offload moves between host and GPU). Each group gives a partial output and LSE; groups
merge exactly by their LSEs (the split-K trick of flash-decoding):

    lse = logaddexp(lse_a, lse_b)        o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

Backward needs only the final o and lse: each group's probabilities are exp(s - lse), so every
group computes its dQ share and its pages' dK/dV independently; dQ shares are summed in group
order (deterministic). The chunk's own keys ride with the first group.
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch

from ..memory.spec import LayerPages

#: yields the groups of a layer's earlier pages on the compute device, at least one (which may
#: hold no page); with_grad=True also brings their dK/dV and writes them back after each group
PageGroups = Callable[[bool], Iterator[LayerPages]]


class AttentionOps(Protocol):
    """A backend (oomb.attention.Backend): one group's attention and its gradient."""

    def forward(self, q, k, v, pages: LayerPages, scale: float, include_self: bool = True): ...

    def backward(self, do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True): ...


def attention_forward(ops: AttentionOps, q, k, v, groups: PageGroups, scale: float, sinks=None):
    """Merged (o fp32 (B, H, C, D), lse fp32 (B, H, C)) over all groups.

    sinks: (H,) learned logits (GPT-OSS) that join each head's softmax denominator with no
    value: one more "group" whose lse is the sink and whose output is zero.
    """
    o = lse = None
    for i, pages in enumerate(groups(False)):
        o_g, lse_g = ops.forward(q, k, v, pages, scale, include_self=i == 0)
        if o is None:
            o, lse = o_g, lse_g
            continue
        o, lse = _merge(o, lse, o_g, lse_g)
    if sinks is not None:
        sink = sinks.float()[None, :, None].expand_as(lse)  # (B, H, C)
        o, lse = _merge(o, lse, torch.zeros_like(o), sink)
    return o, lse


def _merge(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a * torch.exp(lse_a - lse)[..., None] + o_b * torch.exp(lse_b - lse)[..., None], lse


class PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, groups: PageGroups, scale: float, ops: AttentionOps, known=None):
        if known is None:
            o, lse = attention_forward(ops, q, k, v, groups, scale, sinks)
            o = o.to(q.dtype)
        else:  # computed before from the same inputs (stage 1): o in q's dtype, lse fp32
            o, lse = known[0].detach(), known[1]  # a new alias becomes this call's output
        # Only o and the LSE are kept; the pages are read again (in place or staged) in backward.
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.groups, ctx.scale, ctx.ops = groups, scale, ops
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq = dk = dv = None
        for i, pages in enumerate(ctx.groups(True)):
            dq_g, dk_g, dv_g = ctx.ops.backward(do, q, k, v, o, lse, pages, ctx.scale, include_self=i == 0)
            if i == 0:
                dq, dk, dv = dq_g, dk_g, dv_g
            else:
                dq = dq + dq_g
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # o = sum_j p_j v_j with p_j = exp(s_j - lse) and lse including the sink, so
            # do/dsink = -p_sink * o and dL/dsink = -sum_{b,i} p_sink * rowsum(o * do).
            p_sink = torch.exp(sinks.float()[None, :, None] - lse)  # (B, H, C)
            delta = (o.float() * do.float()).sum(-1)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk, dv, dsinks, None, None, None, None
