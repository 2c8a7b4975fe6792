"""Triton paged attention against the PyTorch reference (CPU: TRITON_INTERPRET=1; GPU: -m gpu).

Tolerance habit: every result is compared with a float64 oracle, and the kernel's error must
be at most 3x the error that plain PyTorch makes against the same oracle (the fp32 reference
backend, and plain attention computed in the input dtype), plus a tiny epsilon for results
that torch gets exactly.
"""
import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from oomb.attention import Backend, paged, paged_attention, reference, single_group  # noqa: E402
from oomb.attention.function import PagedAttention  # noqa: E402
from oomb.config import KernelOptions  # noqa: E402
from oomb.memory.store import LayerPages, from_pages  # noqa: E402

CUDA = torch.cuda.is_available()
SCALE = 0.3


def paged_attention_triton(q, k, v, pages, scale, kernels=None):
    return paged_attention(q, k, v, single_group(pages), scale, Backend("triton", kernels))


def paged_attention_torch(q, k, v, pages, scale):
    """The reference (reference.py, fp32 math) with autograd; not the torch backend, whose fused
    CPU path is itself checked against it (test_attention_cpu.py)."""
    return PagedAttention.apply(q, k, v, None, single_group(pages), scale, reference, None)


def paged_attention_forward(q, k, v, pages, scale, kernels=None):
    """(o in q's dtype, lse natural log) of the Triton forward, without autograd."""
    o, lse = paged.forward(q, k, v, pages, scale, kernels=kernels)
    return o.to(q.dtype), lse


def reference_forward(q, k, v, pages, scale):
    o, lse = reference.forward(q, k, v, pages, scale)
    return o.to(q.dtype), lse


def make_case(b, h, n_kv, c, d, page_size, n_pages, dtype, device="cpu", seed=0, spare=3):
    """Random q, k, v (non-contiguous, as from a transpose of (B, C, H, D)), page pools with
    spare unused slots, a random permutation of slots in the table (itself a strided view, as
    the store's table[layer, :, :n_pages] is), and non-zero gradient pools."""
    g = torch.Generator().manual_seed(seed)
    n_slots = b * n_pages + spare

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = rand(b, c, h, d).transpose(1, 2)  # (B, H, C, D) non-contiguous
    k = rand(b, c, n_kv, d).transpose(1, 2)  # (B, Hkv, C, D)
    v = rand(b, c, n_kv, d).transpose(1, 2)
    kp = rand(n_slots, n_kv, page_size, d)  # (n_slots, Hkv, P, D)
    vp = rand(n_slots, n_kv, page_size, d)
    dk0 = torch.randn(n_slots, n_kv, page_size, d, generator=g).to(device)  # fp32 accumulators
    dv0 = torch.randn(n_slots, n_kv, page_size, d, generator=g).to(device)
    slots = torch.randperm(n_slots, generator=g)[: b * n_pages].view(b, n_pages).int()
    tables = torch.full((3, b, n_pages + 2), -1, dtype=torch.int32)
    tables[1, :, :n_pages] = slots
    table = tables.to(device)[1, :, :n_pages]  # (B, n_pages) strided view
    do = rand(b, h, c, d)
    return q, k, v, kp, vp, dk0, dv0, table, do


def attend_plain(q, k, v, n_prev, scale, dtype, page_visible=None):
    """Causal GQA attention with the matmuls in `dtype` (float64: the oracle; 16-bit: what plain
    PyTorch makes in that dtype). q (B, H, C, D); k, v (B, Hkv, n_prev + C, D); page_visible
    (B, Hkv, C, n_prev) bool: which earlier keys each query sees (sparse attention; None: all)."""
    b, h, c, d = q.shape
    n = k.shape[2]
    group = h // k.shape[1]
    k = k.to(dtype).repeat_interleave(group, dim=1)  # (B, H, N, D)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(dtype), k.transpose(-1, -2)).to(acc) * scale  # (B, H, C, N)
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(c, device=q.device)[:, None] + n_prev
    if page_visible is not None:
        own = torch.ones(b, h, c, n - n_prev, dtype=torch.bool, device=q.device)
        visible = visible & torch.cat([page_visible.repeat_interleave(group, dim=1), own], dim=-1)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.softmax(s, dim=-1).to(dtype), v)
    return o, lse


def run_plain(q, k, v, kp, vp, table, do, dtype, page_visible=None):
    """o, lse, dq, dk, dv, dkp, dvp (the last two as (B, Hkv, n*P, D)) of attend_plain."""
    slots = table.long()
    leaves = [x.detach().to(dtype).requires_grad_() for x in (
        q, k, v, from_pages(kp[slots]), from_pages(vp[slots]))]
    q_, k_, v_, kp_, vp_ = leaves
    o, lse = attend_plain(q_, torch.cat([kp_, k_], 2), torch.cat([vp_, v_], 2), kp_.shape[2], SCALE, dtype,
                          page_visible)
    o.backward(do.to(dtype))
    return [o.detach(), lse.detach()] + [x.grad for x in leaves]


def err(x, oracle):
    return (x.double() - oracle).abs().max().item() if oracle.numel() else 0.0


def check(name, got, oracle, *torch_results):
    """Kernel error <= 3x the worst plain-PyTorch error against the float64 oracle + epsilon.

    The epsilon is a few fp32 roundings at the oracle's magnitude (at least 1): it only matters
    where torch is exact, e.g. dq = 0 for a query that sees a single key, which the kernel gets
    as p * (dp - delta), a difference of two fp32 dot products summed in different orders."""
    magnitude = max(1.0, oracle.abs().max().item() if oracle.numel() else 0.0)
    bound = 3 * max(err(t, oracle) for t in torch_results) + 16 * torch.finfo(torch.float32).eps * magnitude
    e = err(got, oracle)
    assert e <= bound, f"{name}: kernel error {e:.3g} > bound {bound:.3g} (torch errors " \
                       f"{[round(err(t, oracle), 9) for t in torch_results]})"


def scatter_pool(pool0, table, grad):
    """pool0 (n_slots, Hkv, P, D) + grad (B, Hkv, n*P, D) at the table's slots, in float64."""
    out = pool0.double().clone()
    n_pages = table.shape[1]
    if n_pages:
        b, n_kv, _, d = grad.shape
        out[table.long()] += grad.double().reshape(b, n_kv, n_pages, -1, d).transpose(1, 2)
    return out


def run_case(b, h, n_kv, c, d, page_size, n_pages, dtype, device, kernels=None, grad_dtype=torch.float32):
    """Forward and backward of one group against the float64 oracle; grad_dtype: the gradient
    pages' (kv_grad_dtype), whose sums the kernel adds in fp32 and rounds once into the page."""
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(b, h, n_kv, c, d, page_size, n_pages, dtype, device)
    dk0, dv0 = dk0.to(grad_dtype), dv0.to(grad_dtype)
    oracle = run_plain(q, k, v, kp, vp, table, do, torch.float64)
    low = run_plain(q, k, v, kp, vp, table, do, dtype)

    # Forward, no autograd.
    pages = LayerPages(kp, vp, None, None, table)
    o, lse = paged_attention_forward(q, k, v, pages, SCALE, kernels)
    ro, rlse = reference_forward(q, k, v, pages, SCALE)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32
    check("o", o, oracle[0], ro, low[0])
    check("lse", lse, oracle[1], rlse, low[1])

    # Backward: kernel vs reference (own copies of the same non-zero gradient pools).
    grads = {}
    for name, fn in (("triton", partial(paged_attention_triton, kernels=kernels)), ("torch", paged_attention_torch)):
        pages = LayerPages(kp, vp, dk0.clone(), dv0.clone(), table)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves, pages, SCALE).backward(do)
        grads[name] = [x.grad for x in leaves] + [pages.dk, pages.dv]
    got, ref = grads["triton"], grads["torch"]
    for i, name in enumerate(("dq", "dk", "dv")):
        assert got[i].dtype == dtype and got[i].shape == (q, k, v)[i].shape
        check(name, got[i], oracle[2 + i], ref[i], low[2 + i])
    for i, (name, pool0) in enumerate((("dk pool", dk0), ("dv pool", dv0))):
        want = scatter_pool(pool0, table, oracle[5 + i])
        assert got[3 + i].dtype == grad_dtype
        # storing the exact sum in the page's dtype is an error torch cannot avoid either
        check(name, got[3 + i], want, ref[3 + i], scatter_pool(pool0, table, low[5 + i]), want.to(grad_dtype))
        unused = torch.ones(pool0.shape[0], dtype=torch.bool, device=device)
        unused[table.long().flatten()] = False
        assert torch.equal(got[3 + i][unused], pool0[unused]), f"{name}: unused slots were written"


# (B, H, Hkv, C, D, P, n_pages): GQA 1/4/7, C 1/17/40/97, D 16/24/32, P 16/32, 0/1/3/5 pages.
CASES = [
    (1, 2, 2, 1, 16, 16, 0),
    (2, 8, 2, 17, 32, 16, 1),
    (1, 7, 1, 40, 24, 32, 5),
    (1, 2, 2, 40, 16, 32, 5),
    (2, 7, 1, 17, 24, 16, 0),
    (1, 8, 2, 1, 32, 32, 5),
    (2, 4, 1, 97, 16, 16, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_matches_reference(case, dtype):
    run_case(*case, dtype, "cpu")


@pytest.mark.parametrize("case", [c for c in CASES if c[4] in (16, 32) and c[6] > 0],
                         ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_pointer_forward_matches_reference(case):
    """OOMB_TMA=0: the forward's and dQ's page tiles through pointers, where 16-bit pools of a
    power-of-two head_dim otherwise go through tensor descriptors (the other cases here)."""
    run_case(*case, torch.float16, "cpu", kernels=KernelOptions(tma=False))


def test_pointer_sparse_forward_matches_reference():
    sparse_case((2, 8, 2, 80, 16, 16, 5, 32), torch.float16, "cpu", 2, kernels=KernelOptions(tma=False))


@pytest.mark.parametrize("on", [True, False], ids=["descriptors", "pointers"])
def test_query_tiles_of_the_dkdv_kernel(monkeypatch, on):
    """The dK/dV pages kernel loads its query tiles (Q, dO) through tensor descriptors by default,
    by pointers with OOMB_DKDV_TMA=0; dense (a chunk of 97 rows: a partial last tile, zero-filled
    past the chunk) and top-k, against the reference."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    taken = []  # per launch of the dK/dV pages kernel: whether Q and dO came as descriptors
    kernel = paged._paged_attn_bwd_dkdv_pages

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                taken.append(all(isinstance(x, TensorDescriptor) for x in args[:2]) and kwargs["TMA"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(paged, "_paged_attn_bwd_dkdv_pages", Spy())
    kernels = KernelOptions(dkdv_tma=on)
    run_case(2, 4, 1, 97, 16, 16, 3, torch.float16, "cpu", kernels)
    sparse_case((2, 8, 2, 80, 16, 16, 5, 32), torch.float16, "cpu", 2, kernels)
    assert taken and all(t == on for t in taken)


def test_tensor_descriptors_where_they_apply():
    """The forward takes the descriptor path (the default, above) for 16-bit pools of a
    power-of-two head_dim, and pointers for fp32 pools, other head_dims and OOMB_TMA=0."""
    def tma(dtype, d, on=True):
        q, k, v, kp, vp, *_ = make_case(1, 4, 2, 8, d, 16, 2, dtype)
        return paged._descriptors((kp, vp), 16, d, on)[-1]

    assert tma(torch.float16, 32) and tma(torch.bfloat16, 128)
    assert not tma(torch.float32, 32) and not tma(torch.float16, 24) and not tma(torch.float16, 32, on=False)


def test_page_slots_in_batches(monkeypatch):
    """The forward loads its pages' pool slots SLOT_BATCH at a time (64 on the GPU) before
    looping over the pages' key tiles: in batches of 2 here, 5 pages make three batches, the last
    partial (dense, descriptor and pointer loads), and a selection two."""
    monkeypatch.setattr(paged, "SLOT_BATCH", 2)
    run_case(2, 8, 2, 40, 16, 16, 5, torch.float16, "cpu")
    sparse_case((2, 8, 2, 80, 16, 16, 5, 32), torch.float16, "cpu", 0)
    run_case(1, 4, 2, 24, 16, 16, 5, torch.float16, "cpu", KernelOptions(tma=False))


def random_selection(b, n_kv, blocks, k, n_logical, seed=1):
    """(B, Hkv, n_blocks, k) int32 ascending logical pages; page 0 in every row (a sink, chosen
    by all blocks: the longest dK/dV program), the others random and distinct."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(n_logical - 1, generator=g)[: k - 1]])
            for _ in range(b * n_kv * blocks)]
    return torch.stack(rows).sort(-1).values.view(b, n_kv, blocks, k).int()


def selected_keys(sel, first_page, n_pages, page_size, c, block):
    """(B, Hkv, C, n_pages * P) bool, by loops over the selection: query i sees the keys of the
    pages its block (i // block) picked inside the group of logical pages first_page.."""
    b, n_kv, blocks, _ = sel.shape
    visible = torch.zeros(b, n_kv, c, n_pages * page_size, dtype=torch.bool)
    for i in range(b):
        for j in range(n_kv):
            for blk in range(blocks):
                for page in sel[i, j, blk].tolist():
                    if first_page <= page < first_page + n_pages:
                        r = page - first_page
                        visible[i, j, blk * block:(blk + 1) * block, r * page_size:(r + 1) * page_size] = True
    return visible


def sparse_case(shape, dtype, device, first_page, kernels=None):
    """Sparse kernels vs a float64 oracle of the same selection (the file's rule: within 3x the
    torch reference's and plain PyTorch's error): o, dq, dk, dv and the pages' dK/dV; and only
    chosen pages' dK/dV change. shape = (B, H, Hkv, C, D, P, n_pages, block): query blocks of
    `block` (the last partial when C is not a multiple), a group of n_pages pages starting at
    logical page `first_page` (picks outside it are skipped)."""
    b, h, n_kv, c, d, page_size, n_pages, block = shape
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(b, h, n_kv, c, d, page_size, n_pages, dtype, device)
    sel = random_selection(b, n_kv, -(-c // block), 3, first_page + n_pages).to(device)
    visible = selected_keys(sel.cpu(), first_page, n_pages, page_size, c, block).to(device)
    oracle = run_plain(q, k, v, kp, vp, table, do, torch.float64, visible)
    low = run_plain(q, k, v, kp, vp, table, do, dtype, visible)
    grads, outs = {}, {}
    for name, fn in (("triton", partial(paged_attention_triton, kernels=kernels)), ("torch", paged_attention_torch)):
        pages = LayerPages(kp, vp, dk0.clone(), dv0.clone(), table, first_page, sel, block)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        outs[name] = fn(*leaves, pages, SCALE)
        outs[name].backward(do)
        grads[name] = [outs[name]] + [x.grad for x in leaves] + [pages.dk, pages.dv]
    got, ref = grads["triton"], grads["torch"]
    for name, g, r, at in zip(("o", "dq", "dk", "dv"), got, ref, (0, 2, 3, 4)):  # run_plain's, less lse (1)
        check(name, g, oracle[at], r, low[at])
    for i, (name, pool0) in enumerate((("dk pool", dk0), ("dv pool", dv0))):
        want = scatter_pool(pool0, table, oracle[5 + i])
        check(name, got[4 + i], want, ref[4 + i], scatter_pool(pool0, table, low[5 + i]), want.to(pool0.dtype))
    chosen = visible.view(b, n_kv, c, n_pages, page_size).any(-1).any(2)  # (B, Hkv, n_pages): picked by a block
    for i in range(b):
        for j in range(n_kv):
            slots = table[i].long()
            changed = (got[4][slots, j] != dk0[slots, j]).flatten(1).any(1)
            assert torch.equal(changed, chosen[i, j]), f"batch {i}, KV head {j}: dK written off the selection"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("first_page", [0, 2], ids=["group0", "later-group"])
def test_sparse_selection_matches_reference(dtype, first_page):
    sparse_case((2, 8, 2, 80, 16, 16, 5, 32), dtype, "cpu", first_page)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-pointers", "fp16-descriptors"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "top-k"])
def test_pool_offsets_past_int32(beyond_int32, dtype, sparse):
    """Pages at pool offsets past 2**31 elements give the same bits as at the pool's start. A
    4,194,304-token step's device pool holds that many: at the Qwen2.5-1.5B shape, the 16 layers
    whose pages `oomb plan` puts on the GPU are 16 x 32,736 slots x 2 KV heads x 128 x 128 = 17.2G
    elements (the 7B at 1M: 20 x 8,160 x 4 x 128 x 128 = 10.7G), so every kernel must compute
    slot * stride in 64 bits (a slot read from the int32 table times an int32 stride overflows). 16-bit pools take the forward's
    and dQ's page tiles through tensor descriptors (int32 slot coordinates, no product), fp32 ones
    through pointers; the dK/dV pages kernel reads and writes through pointers in both."""
    b, h, n_kv, c, d, page_size, n_pages, block = 2, 8, 2, 40, 16, 16, 5, 32
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(b, h, n_kv, c, d, page_size, n_pages, dtype)
    sel = random_selection(b, n_kv, -(-c // block), 3, n_pages) if sparse else None

    def attend(kp, vp, dk, dv, table):
        pages = LayerPages(kp, vp, dk, dv, table, 0, sel, block if sparse else 0)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = paged_attention_triton(*leaves, pages, SCALE)
        o.backward(do)
        return [o] + [x.grad for x in leaves] + [dk[table.long()], dv[table.long()]]

    near = attend(kp, vp, dk0.clone(), dv0.clone(), table)
    far = [beyond_int32(x) for x in (kp, vp, dk0, dv0)]
    shift = far[0][1]  # the same for all four: their slots hold as many elements
    assert (shift + n_pages) * kp[0].numel() > 2**31
    got = attend(*(y for y, _ in far), table + shift)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dk pages", "dv pages"), near, got):
        assert torch.equal(a, b), f"{name}: pages past 2**31 elements differ from the same pages at the start"


def test_no_grad_pages_and_no_grad_mode():
    q, k, v, kp, vp, _, _, table, do = make_case(1, 4, 2, 17, 16, 16, 2, torch.float32)
    kp0, vp0 = kp.clone(), vp.clone()
    pages = LayerPages(kp, vp, None, None, table)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    paged_attention_triton(*leaves, pages, SCALE).backward(do)
    ref = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    paged_attention_torch(*ref, pages, SCALE).backward(do)
    for a, r in zip(leaves, ref):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-5)  # fp32 vs fp32
    assert torch.equal(kp, kp0) and torch.equal(vp, vp0)
    with torch.no_grad():
        o = paged_attention_triton(q, k, v, pages, SCALE)
    assert o.grad_fn is None
    assert torch.equal(o, paged_attention_forward(q, k, v, pages, SCALE)[0])


def backward_twice(device, dtype, shape):
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(*shape, dtype, device)
    runs = []
    for _ in range(2):
        pages = LayerPages(kp, vp, dk0.clone(), dv0.clone(), table)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        paged_attention_triton(*leaves, pages, SCALE).backward(do)
        runs.append([x.grad for x in leaves] + [pages.dk, pages.dv])
    for name, a, b in zip(("dq", "dk", "dv", "dk pool", "dv pool"), *runs):
        assert torch.equal(a, b), f"{name} differs between two identical backward runs"


@pytest.mark.parametrize("case", [(2, 8, 2, 17, 32, 16, 1), (1, 7, 1, 40, 24, 32, 5), (2, 4, 1, 97, 16, 16, 3)],
                         ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_16bit_gradient_pages(case):
    """dK/dV pages in 16 bits (kv_grad_dtype=bfloat16, the 1M-token configuration; float16 here,
    which the interpreter computes exactly where it would compute bf16 on raw bits): the kernel
    loads the page, adds its fp32 sum and rounds once, within 3x of what storing the oracle's
    sum in 16 bits costs."""
    run_case(*case, torch.float16, "cpu", grad_dtype=torch.float16)


@pytest.mark.parametrize("d, page_size, msg", [(320, 16, "head_dim=320"), (16, 24, "page_size=24"),
                                              (16, 8, "page_size=8")])
def test_value_errors(d, page_size, msg):
    q, k, v, kp, vp, _, _, table, _ = make_case(1, 2, 1, 3, d, page_size, 1, torch.float32)
    with pytest.raises(ValueError, match=msg):
        paged_attention_forward(q, k, v, LayerPages(kp, vp, None, None, table), SCALE)


@pytest.mark.parametrize("bad, msg", [
    ("int_grad_pages", r"gradient pages must share one dtype of .*float32.*got torch.int32"),
    ("mixed_grad_pages", r"gradient pages must share one dtype .*got torch.float32/torch.float16"),
    ("lse_shape", r"lse must be float32 \(1, 2, 3\)"),
    ("do_shape", r"do and o must be shaped like q")])
def test_backward_validates_its_inputs(bad, msg):
    """The backward checks its inputs at the backend boundary too (the engine's dK/dV pages reach
    the kernels only there), before any kernel runs."""
    q, k, v, kp, vp, dk, dv, table, do = make_case(1, 2, 1, 3, 16, 16, 1, torch.float32)
    o, lse = paged.forward(q, k, v, LayerPages(kp, vp, None, None, table), SCALE)
    if bad == "int_grad_pages":
        dk, dv = dk.int(), dv.int()
    elif bad == "mixed_grad_pages":
        dv = dv.half()
    elif bad == "lse_shape":
        lse = lse[..., :2]
    else:
        do = do[:, :, :2]
    with pytest.raises(ValueError, match=msg):
        paged.backward(do, q, k, v, o, lse, LayerPages(kp, vp, dk, dv, table), SCALE)


def test_value_error_dtype_mismatch():
    q, k, v, kp, vp, _, _, table, _ = make_case(1, 2, 1, 3, 16, 16, 1, torch.float32)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_attention_forward(q, k, v, LayerPages(kp.half(), vp.half(), None, None, table), SCALE)


# ---- GPU (pytest -m gpu) ----------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES + [(1, 4, 4, 300, 64, 16, 3), (2, 8, 2, 257, 256, 32, 2),
                                          (1, 6, 2, 97, 96, 64, 4), (1, 28, 4, 130, 128, 128, 2)],
                         ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_matches_reference_cuda(case, dtype):
    run_case(*case, dtype, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sparse_selection_matches_reference_cuda(dtype):
    """The target shape's heads and tiles: 28/4 heads, D 128, pages of 128, blocks of 128."""
    sparse_case((1, 28, 4, 640, 128, 128, 12, 128), dtype, "cuda", 3)


@pytest.mark.gpu
@gpu
def test_bf16_realistic_cuda():
    """bf16 at the target shape: kernel error vs the fp32 reference <= 3x plain bf16 PyTorch's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(1, 28, 4, 512, 128, 128, 16, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    # fp32 reference (reference.py computes in fp32) with fp32 copies of everything.
    f32 = [x.float() for x in (q, k, v, kp, vp)]
    pages32 = LayerPages(f32[3], f32[4], dk0.clone(), dv0.clone(), table)
    leaves32 = [x.detach().clone().requires_grad_() for x in f32[:3]]
    o32 = paged_attention_torch(*leaves32, pages32, scale)
    o32.backward(do.float())
    want = [o32.detach()] + [x.grad for x in leaves32] + [pages32.dk - dk0, pages32.dv - dv0]

    # plain PyTorch bf16 attention (matmuls in bf16), gradients by autograd.
    slots = table.long()
    plain = [x.detach().requires_grad_() for x in (q, k, v, from_pages(kp[slots]), from_pages(vp[slots]))]
    o_bf, _ = attend_plain(plain[0], torch.cat([plain[3], plain[1]], 2), torch.cat([plain[4], plain[2]], 2),
                           plain[3].shape[2], scale, torch.bfloat16)
    o_bf.backward(do)
    plain_res = [o_bf.detach()] + [x.grad for x in plain[:3]] + [
        scatter_pool(torch.zeros_like(dk0), table, plain[3].grad).float(),
        scatter_pool(torch.zeros_like(dv0), table, plain[4].grad).float()]

    pages = LayerPages(kp, vp, dk0.clone(), dv0.clone(), table)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = paged_attention_triton(*leaves, pages, scale)
    o.backward(do)
    got = [o.detach()] + [x.grad for x in leaves] + [pages.dk - dk0, pages.dv - dv0]
    for name, g, p, w in zip(("o", "dq", "dk", "dv", "dk pool", "dv pool"), got, plain_res, want):
        e_kernel = (g.float() - w).abs().max().item()
        e_plain = (p.float() - w).abs().max().item()
        assert e_kernel <= 3 * e_plain + 1e-6, f"{name}: kernel {e_kernel:.3g} > 3 x plain bf16 {e_plain:.3g}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [(1, 28, 4, 130, 128, 128, 2), (2, 8, 2, 257, 64, 64, 3), (1, 28, 4, 512, 128, 128, 16)],
                         ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_bf16_gradient_pages_cuda(case):
    """bf16 inputs and bf16 dK/dV pages (the 1M-token configuration) through the Triton kernels
    (the Hopper fused kernel takes fp32 pages only): forward and backward against the float64
    oracle, within 3x plain bf16 PyTorch's error."""
    run_case(*case, torch.bfloat16, "cuda", grad_dtype=torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_deterministic_cuda():
    backward_twice("cuda", torch.bfloat16, (1, 28, 4, 512, 128, 128, 16))


def random_documents(b, t, seed=2):
    """Documents (attention/documents.py) of B sequences of t tokens: random boundaries, among them
    one-token documents, different in every sequence."""
    from oomb.attention.documents import documents
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        starts = torch.randperm(t - 1, generator=g)[: max(1, t // 9)] + 1
        cut = torch.zeros(t, dtype=torch.bool)
        cut[starts] = True
        cut[0] = True
        pos, n = [], 0
        for i in range(t):
            n = 0 if cut[i] else n + 1
            pos.append(n)
        rows.append(pos)
    return documents(torch.tensor(rows))


def packed_case(shape, dtype, gathered=False, kernels=None):
    """Kernels vs the torch reference with packed documents: o, dq, dk, dv and the pages' dK/dV.
    shape = (B, H, Hkv, C, D, P, n_pages, first_page, block): the chunk follows first_page +
    n_pages pages; the group is n_pages pages from first_page (dense), or, with `block`, a top-k
    selection per query block among n_pages pages gathered from all earlier ones (`gathered`: the
    group's columns are random logical pages, as a sparse group's candidates)."""
    b, h, n_kv, c, d, page_size, n_pages, first_page, block = shape
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(b, h, n_kv, c, d, page_size, n_pages, dtype, "cpu")
    q_start = (first_page + n_pages) * page_size
    docs = random_documents(b, q_start + c)
    extra = dict(q_start=q_start, key_start=docs.key_start, doc_end=docs.doc_end)
    if block:
        g = torch.Generator().manual_seed(5)
        sel = torch.stack([torch.randperm(n_pages, generator=g)[:3].sort().values
                           for _ in range(b * n_kv * -(-c // block))]).view(b, n_kv, -1, 3).int()
        extra.update(selection=sel, block_queries=block)
        if gathered:
            extra["logical"] = torch.stack([torch.randperm(first_page + n_pages, generator=g)[:n_pages].sort().values
                                            for _ in range(b)]).int()
            first_page = 0
    assert_triton_equals_reference(q, k, v, do, dtype, lambda name: LayerPages(
        kp, vp, dk0.clone(), dv0.clone(), table, first_page, **extra), partial(paged_attention_triton, kernels=kernels))


def assert_triton_equals_reference(q, k, v, do, dtype, pages_for, triton=paged_attention_triton):
    """The output, dQ, dK, dV and the gradient pools of the Triton kernels and of the reference,
    each run on the pages pages_for('triton' | 'torch') gives, within the dtype's tolerance."""
    results = {}
    for name, fn in (("triton", triton), ("torch", paged_attention_torch)):
        pages = pages_for(name)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves, pages, SCALE)
        o.backward(do)
        results[name] = [o] + [x.grad for x in leaves] + [pages.dk, pages.dv]
    rel = {torch.float32: 1e-5, torch.float16: 5e-3}[dtype]
    for name, got, want in zip(("o", "dq", "dk", "dv", "dk pool", "dv pool"), results["triton"], results["torch"]):
        e, scale = (got.float() - want.float()).abs().max().item(), max(1.0, want.float().abs().max().item())
        assert e <= rel * scale, f"{name}: max error {e:.3g} > {rel} x {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-pointers", "fp16-descriptors"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 97, 16, 16, 3, 2, 0), (1, 7, 1, 40, 24, 32, 2, 0, 0),
                                   (2, 4, 2, 64, 16, 16, 4, 1, 32)],
                         ids=["dense-later-group", "dense-GQA7", "top-k"])
def test_packed_documents_match_reference(shape, dtype):
    """Packed documents (a query sees its own document's keys only): boundaries anywhere in the
    pages and the chunk, one-token documents, GQA; the dense kernels skip the tiles before a
    query tile's documents, the top-k ones mask the selected pages by document."""
    packed_case(shape, dtype)


def test_packed_documents_gathered_pages():
    """A gathered sparse group (its columns: logical pages out of order with the table): key
    positions come from pages.logical."""
    packed_case((2, 4, 2, 64, 16, 16, 4, 2, 32), torch.float32, gathered=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32-pointers", "fp16-descriptors"])
def test_packed_pages_of_finished_documents_are_skipped(dtype):
    """Page tiles wholly before a chunk's first document are skipped, not masked: NaN keys and
    values there (a masked product would still multiply them) leave every result finite and
    equal to the reference's with clean pages. Sequence 0's first document starts 20 keys before
    the chunk, sequence 1's with it (no page is read)."""
    from oomb.attention.documents import documents
    b, h, n_kv, c, d, page_size, n_pages = 2, 4, 2, 40, 16, 16, 4
    q, k, v, kp, vp, dk0, dv0, table, do = make_case(b, h, n_kv, c, d, page_size, n_pages, dtype, "cpu")
    q_start = n_pages * page_size
    pos = torch.stack([torch.cat([torch.arange(q_start - 20), torch.arange(c + 20)]),
                       torch.cat([torch.arange(q_start), torch.arange(c)])])
    docs = documents(pos)
    poisoned_kp, poisoned_vp = kp.clone(), vp.clone()
    for row, first_seen in ((0, q_start - 20), (1, q_start)):
        dead = table[row, : first_seen // page_size].long()  # pages wholly before the first document
        poisoned_kp[dead] = float("nan")
        poisoned_vp[dead] = float("nan")
    pools = {"triton": (poisoned_kp, poisoned_vp), "torch": (kp, vp)}
    assert_triton_equals_reference(q, k, v, do, dtype, lambda name: LayerPages(
        *pools[name], dk0.clone(), dv0.clone(), table, 0, q_start=q_start, key_start=docs.key_start,
        doc_end=docs.doc_end))
