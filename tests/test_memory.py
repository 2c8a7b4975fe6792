"""Page bookkeeping (integers) and the page store (tensors), on CPU."""
import numpy as np
import pytest
import torch

from oomb.memory.pool import PagePool, PoolExhausted
from oomb.memory.spec import KVShape, PageSpec
from oomb.memory.store import PagedKVStore


def test_spec_bytes_qwen25_7b():
    # KV = 28 layers x 2 x 4 heads x 128 x 2 B = 56 KiB per token; fp32 dK/dV twice that.
    spec = PageSpec(page_size=128, n_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert 28 * spec.kv_bytes // 128 == 56 * 1024
    assert 28 * spec.grad_bytes // 128 == 112 * 1024
    assert spec.page_bytes == spec.kv_bytes + spec.grad_bytes


def test_spec_rejects_odd_page_size():
    with pytest.raises(ValueError, match="power of two"):
        PageSpec(page_size=100, n_kv_heads=1, head_dim=16, dtype=torch.float32)


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss", "gemma3", "mistral_window"])
def test_plan_and_engine_build_one_kv_shape(family):
    """The plan's KVShape (from a config) is the engine's (from the model): the same layer kinds,
    pages, representatives and staging, so the plan counts what the engine allocates. Windows of
    24 tokens keep 2 pages of 16 a chunk."""
    import oomb
    from tiny_models import make_model

    model = make_model(family, layers=4)
    config = oomb.EngineConfig(chunk_size=64, page_size=16, sparse=oomb.TopKPages(budget=2),
                               kv_grad_dtype=torch.bfloat16)
    engine = oomb.ChunkRecurrentEngine(model, config)
    shape = KVShape.from_config(model.config, config, torch.float32)
    assert engine.shape == shape and engine.store.shape is engine.shape
    windowed = {"qwen2": (), "gpt_oss": (0, 2), "gemma3": (0, 2), "mistral_window": (0, 1, 2, 3)}[family]
    assert shape.tail_pages == {i: 2 for i in windowed}
    assert shape.full_layers == tuple(i for i in range(4) if i not in windowed)


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
    store = PagedKVStore(KVShape(spec, windows=(0, 0), chunk_pages=2, query_heads=2), device="cpu")
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


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister on a CPU machine: records what was registered and
    whether the memory was still mapped when its registration ended."""

    def __init__(self):
        self.registered, self.unregistered = {}, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append((ptr, _mapped(ptr)))
        del self.registered[ptr]
        return 0


def _mapped(ptr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.fixture
def fake_cudart(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return fake


def test_empty_pinned_exact_aligned_and_unregistered_after_the_last_view(fake_cudart):
    """Exactly the bytes asked for (torch's pinned allocator would round 48 MiB up to 64), page
    aligned, zeroed, registered once; unregistered only when the last view is gone, while the
    memory is still mapped (64 MiB: above malloc's mmap threshold, so freeing unmaps it)."""
    import gc

    from oomb.memory.pinned import PAGE_BYTES, empty_pinned

    shape = (3, 2**20, 4)  # 48 MiB of fp32
    t = empty_pinned(shape, torch.float32)
    ptr, nbytes = t.data_ptr(), 48 * 2**20
    assert t.shape == shape and t.dtype == torch.float32 and ptr % PAGE_BYTES == 0
    assert fake_cudart.registered == {ptr: nbytes} and not t.any()
    big = empty_pinned((64 * 2**20,), torch.uint8)
    view = big[PAGE_BYTES:]
    del big, t
    gc.collect()
    assert fake_cudart.unregistered == [(ptr, True)]  # t had no other view
    view.fill_(1)  # still registered and alive through the view
    assert len(fake_cudart.registered) == 1
    big_ptr = view.data_ptr() - PAGE_BYTES
    del view
    gc.collect()
    assert fake_cudart.unregistered[1] == (big_ptr, True) and not fake_cudart.registered


def test_empty_pinned_without_pinning_is_a_plain_tensor(fake_cudart):
    from oomb.memory.pinned import empty_pinned

    t = empty_pinned((5, 7), torch.bfloat16, pin=False)
    assert t.shape == (5, 7) and t.dtype == torch.bfloat16 and not fake_cudart.registered
    assert empty_pinned((0, 3), torch.float32).numel() == 0 and not fake_cudart.registered


def test_touch_threads_share_the_cpus_between_local_ranks():
    import os

    from oomb.memory.pinned import touch_threads

    cpus = len(os.sched_getaffinity(0))
    assert touch_threads(1) == min(16, cpus)
    assert touch_threads(4 * cpus) == 1


@pytest.mark.gpu
def test_empty_pinned_on_the_gpu_machine():
    """Registered memory is pinned and mapped: asynchronous copies both ways, and a kernel that
    reads host memory directly (offload's row gather), give back the bytes."""
    from oomb.memory.dma import copy_rows
    from oomb.memory.pinned import empty_pinned

    host = empty_pinned((64, 1024), torch.bfloat16)
    assert host.is_pinned()
    src = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    rows = torch.tensor([5, 0, 63], device="cuda")
    gathered = torch.empty(3, 1024, dtype=torch.bfloat16, device="cuda")
    copy_rows(host, rows, gathered, None)
    torch.cuda.synchronize()
    assert torch.equal(back, src) and torch.equal(gathered, src[rows])


def test_runs_of_consecutive_rows():
    from oomb.memory.dma import runs
    starts, lengths = runs(np.array([3, 4, 5, 9, 11, 12, 0]))
    assert starts.tolist() == [0, 3, 4, 6] and lengths.tolist() == [3, 1, 2, 1]
    assert [a.size for a in runs(np.zeros(0, np.int64))] == [0, 0]


def test_row_copies_gather_and_scatter_by_runs(memmove_copier):
    """The copy engines' batch (memmove on CPU) moves what indexing would, one copy per run."""
    from oomb.memory.dma import row_copies
    src = torch.randn(10, 3, 5)
    rows = np.array([2, 3, 4, 7, 0, 1])
    gathered = torch.zeros(6, 3, 5)
    memmove_copier(*row_copies(src, rows, gathered, None), 0)
    assert torch.equal(gathered, src[rows]) and memmove_copier.copies == 3
    back = torch.zeros(10, 3, 5)
    memmove_copier(*row_copies(gathered, None, back, rows), 0)
    assert torch.equal(back[rows], src[rows]) and back[[5, 6, 8, 9]].abs().sum() == 0


@pytest.mark.gpu
def test_batched_copies_on_the_gpu_machine():
    """cuMemcpyBatchAsync through ctypes: a gather of scattered pinned rows to the GPU and the
    scatter back, on a side stream, equal to indexing."""
    from oomb.memory.dma import batch_copier, row_copies
    from oomb.memory.pinned import empty_pinned

    copy = batch_copier()
    assert copy is not None, "the H200 machine's driver (CUDA 13) has cuMemcpyBatchAsync"
    host = empty_pinned((64, 4, 128), torch.bfloat16)
    host.copy_(torch.randn(64, 4, 128).to(torch.bfloat16))
    rows = np.array([5, 6, 7, 0, 63, 30, 31])
    gathered = torch.empty(7, 4, 128, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    copy(*row_copies(host, rows, gathered, None), side.cuda_stream)
    side.synchronize()
    assert torch.equal(gathered.cpu(), host[rows])
    back = empty_pinned((64, 4, 128), torch.bfloat16)
    doubled = gathered * 2
    side.wait_stream(torch.cuda.current_stream())
    copy(*row_copies(doubled, None, back, rows), side.cuda_stream)
    side.synchronize()
    assert torch.equal(back[rows], host[rows] * 2) and back[[1, 2, 3, 4]].abs().sum() == 0


def test_copy_rows_kernel_gathers_and_scatters():
    """The zero-copy gather/scatter kernel (interpreter on CPU) against plain indexing, with fewer
    programs than rows (each takes every programs-th row)."""
    from oomb.memory import dma

    src = torch.randn(10, 3, 5)
    rows = torch.tensor([7, 2, 9, 2])
    out = torch.zeros(4, 3, 5)
    dma._copy_rows_kernel[(3,)](src, rows, out, rows, 4, 15, GATHER=True, SCATTER=False, BLOCK=8)
    assert torch.equal(out, src[rows])
    back = torch.zeros(10, 3, 5)
    dma._copy_rows_kernel[(2,)](out, rows, back, rows[:3], 3, 15, GATHER=False, SCATTER=True, BLOCK=16)
    assert torch.equal(back[rows[:3]], src[rows[:3]]) and back[[0, 1, 3]].abs().sum() == 0


def test_copy_rows_kernel_past_int32(beyond_int32):
    """Rows at offsets past 2**31 elements: a host layer's arena buffer holds max_pages * B rows of
    Hkv * P * D elements (the 7B shape past 4,194,304 tokens: 32,768 x 4 x 128 x 128 = 2**31); the
    kernel computes row * row_elems in 64 bits whatever the row lists' type (int32 here)."""
    from oomb.memory import dma

    src = torch.randn(10, 3, 5)
    far, shift = beyond_int32(src)
    rows = torch.tensor([7, 2, 9, 2], dtype=torch.int32)
    out = torch.zeros(4, 3, 5)
    dma._copy_rows_kernel[(3,)](far, rows + shift, out, rows, 4, 15, GATHER=True, SCATTER=False, BLOCK=8)
    assert torch.equal(out, src[rows])
    back, _ = beyond_int32(torch.zeros(10, 3, 5))
    dma._copy_rows_kernel[(2,)](out, rows[:3], back, rows[:3] + shift, 3, 15, GATHER=False, SCATTER=True,
                                BLOCK=16)
    assert torch.equal(back[shift:][rows[:3]], src[rows[:3]]) and back[shift:][[0, 1, 3]].abs().sum() == 0


@pytest.mark.parametrize("dense_layers", [(), (-1,), (0, -1)])
def test_plan_counts_the_selections_the_engine_keeps(dense_layers):
    """The plan's sparse selections are the bytes of the selections the engine keeps for the step
    (candidates and per-block picks of every chunk and selecting layer); a policy's dense layers
    attend to every page and keep none."""
    import oomb
    from oomb.plan import plan
    from tiny_models import make_model

    model = make_model("qwen2", layers=3)
    config = oomb.EngineConfig(chunk_size=32, page_size=8,
                               sparse=oomb.TopKPages(budget=2, block_queries=16, dense_layers=dense_layers))
    engine = oomb.ChunkRecurrentEngine(model, config)
    ids = torch.randint(0, model.config.vocab_size, (2, 128))
    engine.forward_backward(ids, ids)
    kept = sum(s.pages.nbytes + s.blocks.nbytes for s in engine._selection.values())
    assert kept > 0
    assert plan(model.config, 128, batch=2, engine=config, dtype=torch.float32).selections == kept
