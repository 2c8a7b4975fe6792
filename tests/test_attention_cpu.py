"""The torch backend's fused CPU path (attention/cpu_flash.py) against the reference (reference.py).

Tolerance habit: both are compared with a float64 oracle (plain attention with autograd), and the
fused path's error must be at most 3x the reference's own (fp32 math) plus a few roundings at
the oracle's magnitude. In float64 the fused path computes in float64: its bound is the
reference's fp32 error scaled by the ratio of the two dtypes' epsilons.
"""
import pytest
import torch

from oomb.attention import cpu_flash, reference
from oomb.attention.function import PagedAttention
from oomb.config import KernelOptions
from oomb.memory.spec import LayerPages
from oomb.memory.store import from_pages
from test_attention_triton import CASES, scatter_pool  # (B, H, Hkv, C, D, P, n_pages) shapes; pools + grads

SCALE = 0.3
pytestmark = pytest.mark.skipif(cpu_flash.fused_ops() is None, reason="this torch has no CPU flash attention op")


def make_case(b, h, n_kv, c, d, page_size, n_pages, dtype, seed=0, spare=3):
    """q, k, v (non-contiguous, as from a transpose of (B, C, H, D)), page pools with spare slots,
    a random slot permutation in the table, non-zero fp32 gradient pools, and do."""
    g = torch.Generator().manual_seed(seed)
    n_slots = b * n_pages + spare

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q = rand(b, c, h, d).transpose(1, 2)  # (B, H, C, D)
    k = rand(b, c, n_kv, d).transpose(1, 2)  # (B, Hkv, C, D)
    v = rand(b, c, n_kv, d).transpose(1, 2)
    kp, vp = rand(n_slots, n_kv, page_size, d), rand(n_slots, n_kv, page_size, d)  # (n_slots, Hkv, P, D)
    dk0, dv0 = (torch.randn(n_slots, n_kv, page_size, d, generator=g) for _ in range(2))
    table = torch.randperm(n_slots, generator=g)[: b * n_pages].view(b, n_pages).int()
    return q, k, v, kp, vp, dk0, dv0, table, rand(b, h, c, d)


def oracle(q, k, v, kp, vp, table, do, include_self):
    """float64 (o, lse, dq, dk, dv, dkp, dvp) of plain attention: every page, then (causally) the
    chunk; dkp, dvp as (B, Hkv, n*P, D)."""
    slots = table.long()
    q, k, v, kp, vp = (x.detach().double().requires_grad_() for x in (q, k, v, from_pages(kp[slots]),
                                                                          from_pages(vp[slots])))
    b, h, c, d = q.shape
    keys, values = (torch.cat([p, s], 2) if include_self else p for p, s in ((kp, k), (vp, v)))
    g = h // k.shape[1]
    s = q @ keys.repeat_interleave(g, 1).transpose(-1, -2) * SCALE  # (B, H, C, N)
    n_prev = kp.shape[2]
    visible = torch.arange(keys.shape[2])[None, :] <= torch.arange(c)[:, None] + n_prev
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1).nan_to_num() @ values.repeat_interleave(g, 1)
    o.backward(do.double())
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad, kp.grad, vp.grad]


def err(x, want):
    return (x.double() - want).abs().max().item() if want.numel() else 0.0


def check(name, got, ref, want, dtype):
    magnitude = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    ratio = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps  # 1 in fp32
    bound = (3 * err(ref, want) * ratio + 16 * torch.finfo(dtype).eps * magnitude)
    e = err(got, want)
    assert e <= bound, f"{name}: fused error {e:.3g} > bound {bound:.3g} (reference error {err(ref, want):.3g})"


def run(module, q, k, v, kp, vp, dk0, dv0, table, do, include_self):
    """Forward and backward of one group through `module` (cpu_flash or reference), as the
    engine calls them: backward gets the forward's o and lse."""
    pages = LayerPages(kp, vp, dk0.clone(), dv0.clone(), table)
    o, lse = module.forward(q, k, v, pages, SCALE, include_self)
    dq, dk, dv = module.backward(do, q, k, v, o.to(q.dtype), lse, pages, SCALE, include_self)
    return o, lse, dq, dk, dv, pages.dk, pages.dv


@pytest.mark.parametrize("include_self", [True, False], ids=["with_chunk", "pages_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_fused_matches_reference(case, dtype, include_self):
    if not include_self and case[-1] == 0:
        pytest.skip("a group of no page and no chunk: covered by test_empty_group")
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(*case, dtype)
    want = oracle(q, k, v, kp, vp, table, do, include_self)
    # the reference's own error: fp32 math, from fp32 copies of the same inputs
    ref = run(reference, *(x.float() for x in (q, k, v, kp, vp)), dk0, dv0, table, do.float(), include_self)
    got = run(cpu_flash, q, k, v, kp, vp, dk0, dv0, table, do, include_self)
    assert got[0].dtype == got[2].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for i, name in enumerate(("o", "lse", "dq")):
        check(name, got[i], ref[i], want[i], dtype)
    if include_self:
        for i, name in ((3, "dk"), (4, "dv")):
            assert got[i].dtype == dtype and got[i].shape == k.shape
            check(name, got[i], ref[i], want[i], dtype)
    else:
        assert got[3] is None and got[4] is None
    for i, (name, pool0) in enumerate((("dk pool", dk0), ("dv pool", dv0))):  # fp32 accumulators
        check(name, got[5 + i], ref[5 + i], scatter_pool(pool0, table, want[5 + i]), pool0.dtype)
        unused = torch.ones(pool0.shape[0], dtype=torch.bool)
        unused[table.long().flatten()] = False
        assert torch.equal(got[5 + i][unused], pool0[unused]), f"{name}: unused slots were written"


def test_groups_merge_like_the_reference():
    """Pages in two groups (the second without the chunk), merged by function.py with a sink: the
    fused path's output and gradients are the reference's up to fp32 rounding, and its backward
    is deterministic."""
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(2, 8, 2, 33, 32, 16, 5, torch.float32, seed=1)
    sinks = torch.randn(8)

    def groups_of(dk, dv):
        first, second = table[:, :2], table[:, 2:]
        return lambda with_grad: iter([LayerPages(kp, vp, dk, dv, first),
                                       LayerPages(kp, vp, dk, dv, second, first_page=2)])

    results = {}
    for name, module in (("reference", reference), ("fused", cpu_flash), ("fused again", cpu_flash)):
        dk, dv = dk0.clone(), dv0.clone()
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
        o = PagedAttention.apply(*leaves, groups_of(dk, dv), SCALE, module, None)
        o.backward(do)
        results[name] = [o.detach()] + [x.grad for x in leaves] + [dk, dv]
    for got, ref, name in zip(results["fused"], results["reference"], ("o", "dq", "dk", "dv", "dsinks", "dkp", "dvp")):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (name, (got - ref).abs().max())
    assert all(torch.equal(a, b) for a, b in zip(results["fused"], results["fused again"]))


def test_empty_group():
    """A later group that holds no page: nothing seen (o = 0, lse = -inf) and no gradient."""
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(1, 4, 2, 9, 16, 16, 0, torch.float32)
    o, lse, dq, dk, dv, dkp, dvp = run(cpu_flash, q, k, v, kp, vp, dk0, dv0, table, do, False)
    assert not o.any() and torch.isneginf(lse).all() and not dq.any() and dk is None and dv is None
    assert torch.equal(dkp, dk0) and torch.equal(dvp, dv0)


def test_masks_the_op_cannot_express_take_the_reference(monkeypatch):
    """Sparse selections and sliding windows run in reference.py (the op's only masks are none and
    top-left causal), and so do tensors off the CPU and everything under OOMB_CPU_FLASH=0; a dense
    CPU group does not."""
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(1, 4, 2, 16, 16, 16, 2, torch.float32)
    dense = LayerPages(kp, vp, dk0, dv0, table)
    selection = torch.zeros((1, 2, 1, 1), dtype=torch.int32)
    assert cpu_flash.fused(q, dense)
    assert not cpu_flash.fused(q, dense._replace(selection=selection, block_queries=16))
    assert not cpu_flash.fused(q, dense._replace(window=8, q_start=32))
    assert not cpu_flash.fused(q.to("meta"), dense)
    assert not cpu_flash.fused(q, dense, KernelOptions(cpu_flash=False))  # OOMB_CPU_FLASH=0
    calls = []
    real = reference.forward
    monkeypatch.setattr(reference, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cpu_flash.forward(q, k, v, dense._replace(window=8, q_start=32), SCALE)
    assert calls == [1]
    cpu_flash.forward(q, k, v, dense, SCALE)
    assert calls == [1]
