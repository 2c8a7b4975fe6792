"""placement.place(): one pure function decides where a step's pages and kept outputs go, for the
engine and for `oomb plan` alike."""
import dataclasses

import pytest
import torch

import oomb
from oomb.placement import PlacementInput, place
from oomb.plan import GPU_MARGIN_BYTES, plan
from oomb.plan import place as plan_place
from tiny_models import make_model

MiB = 2**20


def test_offload_modes():
    x = PlacementInput("none", full_layers=4, layer_bytes=10 * MiB, window_bytes=MiB, staging_bytes=2 * MiB,
                       gpu_room=15 * MiB)
    assert place(x) == place(dataclasses.replace(x, gpu_room=None))  # 'none' does not look at the room
    p = place(x)
    assert (p.device_layers, p.host_layers, p.staging, p.gpu_bytes, p.host_bytes) == (4, 0, 0, 41 * MiB, 0)
    p = place(dataclasses.replace(x, offload="all"))
    assert (p.device_layers, p.host_layers, p.staging, p.gpu_bytes, p.host_bytes) == (0, 4, 2 * MiB, 3 * MiB,
                                                                                      40 * MiB)


@pytest.mark.parametrize("room_mib, on_gpu", [(22, 1), (23, 2), (33, 3), (100, 4), (2, 0), (-5, 0)])
def test_auto_keeps_whole_layers_while_they_fit_beside_windows_and_staging(room_mib, on_gpu):
    x = PlacementInput("auto", full_layers=4, layer_bytes=10 * MiB, window_bytes=MiB, staging_bytes=2 * MiB,
                       gpu_room=room_mib * MiB)
    p = place(x)
    assert p.device_layers == on_gpu and p.host_layers == 4 - on_gpu
    assert p.staging == (2 * MiB if on_gpu < 4 else 0)
    assert p.gpu_bytes == MiB + on_gpu * 10 * MiB + p.staging and p.host_bytes == (4 - on_gpu) * 10 * MiB
    # a page budget given (gpu_page_budget_bytes) decides instead of the room
    assert place(dataclasses.replace(x, page_budget=25 * MiB)).device_layers == 2


def test_kept_outputs_fill_the_room_then_the_host_budget():
    x = PlacementInput("none", full_layers=2, layer_bytes=10 * MiB, gpu_room=27 * MiB, kept_layers=5,
                       kept_gpu_bytes=3 * MiB, kept_host_bytes=4 * MiB, kept_host_budget=9 * MiB)
    p = place(x)  # 7 MiB left beside the pages: 2 layers on the GPU; 9 MiB of host: 2 more
    assert (p.kept_gpu, p.kept_host, p.kept) == (2, 2, 4)
    assert p.gpu_bytes == 20 * MiB + 6 * MiB and p.host_bytes == 8 * MiB
    assert place(dataclasses.replace(x, kept_host_budget=None)).kept == 5  # no host limit: every layer
    assert place(dataclasses.replace(x, gpu_room=None)).kept_gpu == 0  # a CPU model keeps in host memory
    with pytest.raises(ValueError, match=r"keep_attention=True: the attention outputs of 3 layers need 12.0 MiB "
                                         r"of pinned host memory \(2 more layers' fit on the GPU beside the pages\), "
                                         r"but the budget is 9.0 MiB: 2 layers would fit"):
        place(dataclasses.replace(x, keep_all=True))


def test_pages_held_from_a_longer_step_leave_less_room_for_kept_outputs():
    """The engine's page pool only grows: a step shorter than an earlier one (a warm-up after
    reserving for the real length) still holds the longer step's pages, so kept outputs get only
    the room beside those (on the H200 capped to 24 GiB, a 135K-token warm-up after reserving
    1M tokens filled the pool's difference with kept outputs and ran out)."""
    x = PlacementInput("auto", full_layers=2, layer_bytes=2 * MiB, gpu_room=27 * MiB, kept_layers=9,
                       kept_gpu_bytes=3 * MiB)
    assert (place(x).device_layers, place(x).kept_gpu) == (2, 7)  # 23 MiB beside 4 MiB of pages
    held = place(dataclasses.replace(x, held_bytes=20 * MiB))  # a longer step's 2 x 10 MiB
    assert (held.device_layers, held.kept_gpu, held.gpu_bytes) == (2, 2, 20 * MiB + 6 * MiB)
    assert place(dataclasses.replace(x, held_bytes=MiB)).kept_gpu == 7  # less than the step's own pages


def test_unknown_offload_mode():
    with pytest.raises(ValueError, match=r"offload='some' is not one of \('none', 'all', 'auto'\)"):
        PlacementInput("some", full_layers=1, layer_bytes=1)


@pytest.mark.parametrize("sparse", [None, oomb.TopKPages(budget=2, block_queries=32, chunk_budget=3)])
@pytest.mark.parametrize("room_layers", [0.5, 1.5, 3])
def test_engine_and_plan_place_a_step_alike(monkeypatch, sparse, room_layers):
    """The engine's numbers (measured room, its store's sizes) and the plan's (computed from the
    config, the room given as GPU capacity less what the plan puts beside the pages) make the
    same placement: the same layers on the GPU, staging and bytes."""
    model = make_model("qwen2", layers=3)
    config = oomb.EngineConfig(chunk_size=32, page_size=16, offload="auto", sparse=sparse, group_pages=4)
    engine = oomb.ChunkRecurrentEngine(model, config)
    seq_len, batch = 320, 2
    max_pages = (seq_len // 32 - 1) * 2
    layer = batch * max_pages * engine.store.layer_page_bytes
    staging = engine.placement_input(batch, max_pages).staging_bytes
    room = staging + int(room_layers * layer)
    monkeypatch.setattr(engine.memory, "device", torch.device("cuda"))  # decides as on a GPU with this room
    monkeypatch.setattr(engine.memory, "headroom", lambda cfg: room)
    mine = place(engine.placement_input(batch, max_pages))
    p = plan(model.config, seq_len, batch=batch, engine=config, dtype=torch.float32)
    beside = p.weights + p.grads + p.optimizer + p.working_set + p.selections + GPU_MARGIN_BYTES
    planned = plan_place(p, "auto", room + beside, 2**40).decision
    assert mine == planned and mine.device_layers == min(3, int(room_layers))
