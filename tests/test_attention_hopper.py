"""The Hopper (Gluon) backward over pages, attention/paged_hopper.py.

CPU: the page bounds kernel (TRITON_INTERPRET=1) against torch, and the fixed-point dQ scheme in
float64: every share fits, any order of integer sums fits int32, and the sum is dQ. GPU (-m gpu,
Hopper, a Triton where paged_hopper.AVAILABLE): the kernel against the float64 oracle
(test_attention_triton's run_case), and bitwise determinism.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

from oomb import KernelOptions  # noqa: E402
from oomb.attention import paged_hopper, resolve_backend  # noqa: E402
from oomb.memory.store import LayerPages  # noqa: E402
from test_attention_triton import backward_twice, make_case, run_case  # noqa: E402


def test_page_bounds_match_torch():
    _, _, _, kp, vp, _, _, table, _ = make_case(2, 4, 2, 3, 24, 16, 5, torch.float32, seed=1)
    kp[table[1, 2]] *= 7  # one page of the second sequence dominates both bounds
    columns = table.t().contiguous().t()  # the same table with strides (1, B)
    got = paged_hopper.page_bounds(LayerPages(kp, vp, None, None, columns))  # (B, Hkv, 2)
    k, v = kp[table.long()], vp[table.long()]  # (B, n_pages, Hkv, P, D)
    want = torch.stack([k.abs().amax((1, 3, 4)), v.norm(dim=-1).amax((1, 3))], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_fixed_point_dq_fits_int32_in_any_order_and_sums_to_dq():
    """The kernel adds each page tile's dQ share as round(share * 2^e) into int32: the sum of the
    shares' magnitudes (a bound on every partial sum, whatever the order) must stay below 2^31,
    and the integer sum must be dQ to within the roundings. Peaked attention (one key much larger)
    and a zero dO row are the hard cases."""
    g = torch.Generator().manual_seed(0)
    b, h, n_kv, c, d, page_size, n_pages = 1, 4, 2, 6, 16, 16, 8
    scale = d ** -0.5
    kp = torch.randn(n_pages, n_kv, page_size, d, generator=g)
    vp = torch.randn(n_pages, n_kv, page_size, d, generator=g)
    kp[3, :, 5] *= 6  # a key every query attends strongly
    vp[3, :, 5] *= 4
    table = torch.arange(n_pages, dtype=torch.int32)[None]
    q = torch.randn(b, h, c, d, generator=g) * 3
    do = torch.randn(b, h, c, d, generator=g)
    do[:, 1, 2] = 0  # a row with nothing to add

    k = kp.transpose(0, 1).reshape(n_kv, -1, d).double().repeat_interleave(h // n_kv, 0)[None]  # (B, H, N, D)
    v = vp.transpose(0, 1).reshape(n_kv, -1, d).double().repeat_interleave(h // n_kv, 0)[None]
    p = torch.softmax(scale * q.double() @ k.transpose(-1, -2), dim=-1)  # pages only: each row sums to 1
    dp = do.double() @ v.transpose(-1, -2)
    delta = (p * dp).sum(-1)  # = rowsum(O * dO)
    ds = p * (dp - delta[..., None])
    shares = torch.stack([scale * ds[..., t:t + page_size] @ k[:, :, t:t + page_size]
                          for t in range(0, n_pages * page_size, page_size)])  # (tiles, B, H, C, D)

    e = paged_hopper.dq_exponents(do, delta.float(), paged_hopper.page_bounds(LayerPages(kp, vp, None, None, table)),
                                  scale).double()[..., None]
    ints = torch.round(shares * torch.exp2(e))
    assert ints.abs().sum(0).max() < 2 ** 30, "partial sums could overflow int32"
    dq_fixed = ints.sum(0) * torch.exp2(-e)
    dq = scale * ds @ k
    rounding = n_pages * 0.5 * torch.exp2(-e)
    assert ((dq_fixed - dq).abs() <= rounding).all()
    assert (dq_fixed - dq).abs().max() <= 1e-6 * dq.abs().max(), "the exponents waste precision"
    assert (dq_fixed[:, 1, 2] == 0).all()


def test_not_eligible_off_hopper():
    q, k, v, kp, vp, dk0, dv0, table, _ = make_case(1, 28, 4, 64, 128, 128, 2, torch.bfloat16)
    assert not paged_hopper.eligible(q, LayerPages(kp, vp, dk0, dv0, table))  # a CPU tensor


def test_backend_names_its_kernels(monkeypatch):
    """The trainer's first line prints the backend: on CUDA it says whether dense pages' backward
    can take the fused kernel ('kernels: hopper-fused') or not ('kernels: triton': another GPU, a
    Triton without the Gluon features, or OOMB_GLUON=0), never falling back unnamed."""
    cuda = torch.device("cuda")  # resolve_backend and str() only read its type and capability
    assert str(resolve_backend("auto", torch.device("cpu"))) == "torch"
    assert str(resolve_backend("triton", torch.device("cpu"))) == "triton, kernels: triton"
    monkeypatch.setattr(paged_hopper, "AVAILABLE", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert str(resolve_backend("auto", cuda)) == "triton, kernels: hopper-fused"
    assert str(resolve_backend("auto", cuda, KernelOptions(gluon=False))) == "triton, kernels: triton"
    monkeypatch.setattr(paged_hopper, "AVAILABLE", False)
    assert str(resolve_backend("auto", cuda)) == "triton, kernels: triton"
    monkeypatch.setattr(paged_hopper, "AVAILABLE", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert str(resolve_backend("auto", cuda)) == "triton, kernels: triton"


# ---- GPU (pytest -m gpu) ----------------------------------------------------------------

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not (HOPPER and paged_hopper.AVAILABLE),
                            reason="needs a Hopper GPU" if paged_hopper.AVAILABLE else
                            f"Triton {triton.__version__} lacks Gluon features paged_hopper uses")
# (B, H, Hkv, C, D, P, n_pages): the target's heads (GQA 7), pages of 256 (two tiles a page), GQA 1.
SHAPES = [(1, 28, 4, 512, 128, 128, 16), (2, 8, 2, 192, 128, 256, 3), (1, 4, 4, 128, 128, 128, 5)]


def _assert_eligible(shape, dtype):
    q, k, v, kp, vp, dk0, dv0, table, _ = make_case(*shape, dtype, "cuda")
    assert paged_hopper.eligible(q, LayerPages(kp, vp, dk0, dv0, table)), f"{shape} {dtype} takes the Triton path"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "B{}H{}kv{}C{}D{}P{}n{}".format(*c))
def test_matches_reference_cuda(shape, dtype):
    _assert_eligible(shape, dtype)
    run_case(*shape, dtype, "cuda")


@pytest.mark.gpu
@hopper
def test_deterministic_cuda():
    _assert_eligible(SHAPES[0], torch.bfloat16)
    backward_twice("cuda", torch.bfloat16, SHAPES[0])
