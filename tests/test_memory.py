"""Page bookkeeping (integers) and the page store (tensors), on CPU."""
import pytest
import torch

from oomb.memory.pool import PagePool, PoolExhausted
from oomb.memory.spec import PageSpec
from oomb.memory.store import PagedKVStore


def test_spec_bytes_qwen25_7b():
    # design.md §3: KV = 28 layers x 2 x 4 heads x 128 x 2 B = 56 KiB per token; fp32 dK/dV twice that.
    spec = PageSpec(page_size=128, n_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert 28 * spec.kv_bytes // 128 == 56 * 1024
    assert 28 * spec.grad_bytes // 128 == 112 * 1024
    assert spec.page_bytes == spec.kv_bytes + spec.grad_bytes


def test_spec_rejects_odd_page_size():
    with pytest.raises(ValueError, match="power of two"):
        PageSpec(page_size=100, n_kv_heads=1, head_dim=16, dtype=torch.float32)


def test_pool_alloc_free_reuse():
    pool = PagePool(8, page_bytes=1024)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.n_free == 5
    b = pool.alloc(2)
    assert b == [3, 4]
    pool.free(a)
    assert pool.alloc(3) == a  # the same slots, in the same order
    pool.free(b)
    pool.grow(10)
    assert pool.n_slots == 10 and pool.n_free == 7


def test_pool_exhaustion_names_the_bytes():
    pool = PagePool(4, page_bytes=2**20)
    pool.alloc(3)
    with pytest.raises(PoolExhausted, match=r"5 pages requested, 1 of 4 free; 4 more pages \(4.0 MiB\)"):
        pool.alloc(5)


def test_pool_double_free_is_a_bug():
    pool = PagePool(2)
    ids = pool.alloc(1)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)


def test_store_roundtrip_and_grad_pages():
    spec = PageSpec(page_size=4, n_kv_heads=2, head_dim=3, dtype=torch.float32)
    store = PagedKVStore(spec, n_layers=2, device="cpu")
    store.begin_step(batch=2, max_pages=4)
    store.alloc_chunk(0, first_page=0, n_pages=2)
    store.alloc_chunk(1, first_page=2, n_pages=2)
    k = torch.randn(2, 2, 8, 3)
    v = torch.randn(2, 2, 8, 3)
    store.write(1, 2, k, v)
    from oomb.attention.reference import gather_pages
    (pages,) = store.page_groups(1, 4)(True)
    kp, vp = gather_pages(pages)
    assert torch.equal(kp[:, :, 8:], k) and torch.equal(vp[:, :, 8:], v)
    dk, dv = store.chunk_grads(1, 2, 2)()
    assert dk.shape == k.shape and not dk.any() and not dv.any()
    # all slots distinct across layers, sequences and pages
    assert store.table.unique().numel() == store.table.numel() == 2 * 2 * 4
    store.free_all()
    assert store.pool.n_free == store.pool.n_slots
