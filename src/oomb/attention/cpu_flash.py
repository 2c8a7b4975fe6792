"""Paged attention through PyTorch's fused CPU flash attention: the torch backend on the CPU.

Same interface and results as reference.py (the oracle), which materialises every score of a
group in fp32: (G*C, N) scores, their mask, exp and logsumexp per KV head. The fused op tiles
the keys and keeps only a tile of scores (it is what transformers' SDPA runs on the CPU): the
tiny preset's 4,096-token step takes 0.53 s with it, 2.85 s with the reference
(bench/bench_cpu_step.py, 2 cores). A group is at most two calls of it, merged by their LSEs
exactly as function.py merges groups:

  - the group's pages: every query sees every key, no mask. The G query heads of a KV head are
    one sequence of G*C queries against its keys (GQA folded: each KV head's pages read once,
    whether or not a torch release's op takes fewer KV heads than query heads itself);
  - the chunk's own keys (first group only): causal. The op's causal mask is aligned top-left
    (query i sees keys 0 .. i), so it is the chunk's own only when queries and keys are the
    same C tokens: the chunk's K/V are repeated to the H query heads (C tokens, cheap).

Backward: the op's backward takes o and the LSE and recomputes p = exp(s - lse) and
delta = rowsum(o * do); given the final o and LSE of all groups it gives each call's exact
share, as reference.backward does, and the pages' share of dK/dV is added into their
gradient pages.

What the op cannot express without a materialised mask runs in reference.py instead:
sparse groups (each block of queries sees its own selection of pages), sliding windows
(GPT-OSS's windowed layers; their full-attention layers, sinks included, take the fused op) and
packed documents (each query sees its own document's keys only).
So do tensors that are not on the CPU (the torch backend on CUDA), a torch without the op, and
every group under KernelOptions(cpu_flash=False) (OOMB_CPU_FLASH=0 at the command line).
Math is in fp32 (fp64 inputs: in fp64), like the reference.
"""
from __future__ import annotations

import functools

import torch

from ..memory.spec import LayerPages
from . import reference

_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


@functools.cache
def fused_ops():
    """(forward, backward) of torch's CPU flash attention, or None where this torch lacks them.

    forward(q, k, v, dropout_p, is_causal, *, scale) -> (o, lse);
    backward(do, q, k, v, o, lse, dropout_p, is_causal, *, scale) -> (dq, dk, dv).
    """
    if not (hasattr(torch.ops.aten, _FORWARD) and hasattr(torch.ops.aten, _BACKWARD)):
        return None
    return getattr(torch.ops.aten, _FORWARD), getattr(torch.ops.aten, _BACKWARD)


def fused(q: torch.Tensor, pages: LayerPages, kernels=None) -> bool:
    """Whether a group runs in the fused op (else: reference.py); kernels: an oomb.KernelOptions
    (cpu_flash=False: every group through reference.py, for before/after runs)."""
    return ((kernels is None or kernels.cpu_flash) and q.device.type == "cpu" and pages.selection is None and not pages.window
            and pages.key_start is None and fused_ops() is not None)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def forward(q, k, v, pages: LayerPages, scale: float, include_self: bool = True, kernels=None):
    """One group's part of paged attention: (o (B, H, C, D), lse (B, H, C)), fp32 (fp64 for fp64
    inputs), natural log; reference.forward's contract."""
    if not fused(q, pages, kernels):
        return reference.forward(q, k, v, pages, scale, include_self)
    attend = fused_ops()[0]
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    dtype = _compute_dtype(q)
    qc = q.to(dtype)
    parts = []
    if pages.n_pages > 0:
        kp, vp = (x.to(dtype) for x in reference.gather_pages(pages))  # (B, Hkv, n*P, D)
        o_p, lse_p = attend(qc.reshape(b, n_kv, -1, d), kp, vp, scale=scale)  # (B, Hkv, G*C, D), (B, Hkv, G*C)
        parts.append((o_p.reshape(b, h, c, d), lse_p.reshape(b, h, c)))
    if include_self:
        ks, vs = (x.to(dtype).repeat_interleave(h // n_kv, dim=1) for x in (k, v))  # (B, H, C, D)
        parts.append(attend(qc, ks, vs, 0.0, True, scale=scale))
    if not parts:  # a later group without pages: nothing seen, o = 0 and lse = -inf
        return q.new_zeros((b, h, c, d), dtype=dtype), q.new_full((b, h, c), float("-inf"), dtype=dtype)
    o, lse = parts[0]
    if len(parts) == 2:
        (o_s, lse_s) = parts[1]
        lse_both = torch.logaddexp(lse, lse_s)
        o = o * torch.exp(lse - lse_both)[..., None] + o_s * torch.exp(lse_s - lse_both)[..., None]
        lse = lse_both
    return o, lse


def backward(do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True, kernels=None):
    """One group's part of the attention gradient, given the final o and lse of all groups:
    (dq (B, H, C, D) fp32, dk, dv of the chunk's own keys in k's dtype or None without
    include_self); the pages' dK/dV are added into pages.dk / pages.dv. reference.backward's
    contract, and its formulas, computed by the op's backward a call at a time."""
    if not fused(q, pages, kernels):
        return reference.backward(do, q, k, v, o, lse, pages, scale, include_self)
    grad = fused_ops()[1]
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    dtype = _compute_dtype(q)
    qc, doc, oc = (x.to(dtype) for x in (q, do, o))
    lsec = lse.to(dtype).contiguous()  # (B, H, C)
    dq = torch.zeros((b, h, c, d), dtype=dtype, device=q.device)
    if pages.n_pages > 0:
        kp, vp = (x.to(dtype) for x in reference.gather_pages(pages))  # (B, Hkv, n*P, D)
        fold = (b, n_kv, -1, d)  # (B, Hkv, G*C, D): the G heads of a KV head as one sequence
        dq_p, dk_p, dv_p = grad(doc.reshape(fold), qc.reshape(fold), kp, vp, oc.reshape(fold),
                                lsec.reshape(b, n_kv, -1), 0.0, False, scale=scale)
        dq += dq_p.reshape(b, h, c, d)
        if pages.dk is not None:
            slots = pages.table.long()
            reference.accumulate_pages(pages.dk, slots, dk_p)
            reference.accumulate_pages(pages.dv, slots, dv_p)
    if not include_self:
        return dq, None, None
    g = h // n_kv
    ks, vs = (x.to(dtype).repeat_interleave(g, dim=1) for x in (k, v))  # (B, H, C, D)
    dq_s, dk_s, dv_s = grad(doc, qc, ks, vs, oc, lsec, 0.0, True, scale=scale)
    dq += dq_s
    # the G query heads that shared a KV head each gave it a share: (B, H, C, D) -> (B, Hkv, C, D)
    dk = dk_s.reshape(b, n_kv, g, c, d).sum(2)
    dv = dv_s.reshape(b, n_kv, g, c, d).sum(2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
