"""What `oomb plan` gives the steps the rows measured: the GPU memory a step's placement needs
(planned_peak, checked against each measured peak), the longest context a row's settings fit and
the longest `oomb train`'s automatic configuration reaches at a GPU cap.
"""
from __future__ import annotations

from common import BENCH_LORA_TARGETS
from report_common import H200_GIB, OFFLOAD, PRESET_LAYERS, own_peaks, shipped

PLAN_HOST_GIB = 110  # what `oomb plan` assumes a 128 GiB machine leaves for pinned pages


def row_engine(r: dict):
    """(model config, EngineConfig, trainable parameters or None) of an oomb row's step."""
    import torch

    from oomb.attention.sparse import TopKPages
    from oomb.config import EngineConfig
    from oomb.plan import lora_params
    from oomb.presets import preset_config

    config = preset_config(r.get("model", "qwen2.5-7b"))
    engine = EngineConfig(chunk_size=r["chunk_size"], offload=OFFLOAD[r["impl"]],
                          sparse=TopKPages(budget=64) if "sparse" in r["impl"] else None,
                          kv_grad_dtype=torch.bfloat16 if r.get("kv_grad_dtype") == "bf16" else torch.float32,
                          checkpoint_layers=bool(r.get("checkpoint_layers")), compile_layers=bool(r.get("compile")),
                          param_grad_dtype=torch.float32 if r.get("param_grad_dtype") == "fp32" else None,
                          group_pages=r.get("group_pages") or 1024, keep_attention=False)
    trainable = lora_params(config, r["lora_rank"], targets=BENCH_LORA_TARGETS) if r.get("lora_rank") else None
    return config, engine, trainable


def planned_longest(r: dict) -> int:
    """The longest context `oomb plan` says a step of row r's model and settings fits on one H200
    with PLAN_HOST_GIB of host memory (gradients only, as bench_step.py's step)."""
    from oomb.plan import longest_context, place, plan

    config, engine, trainable = row_engine(r)

    def fits(n: int) -> bool:
        p = plan(config, n, engine=engine, trainable_params=trainable, optimizer_bytes_per_param=0)
        return place(p, engine.offload, int(H200_GIB * 2**30), PLAN_HOST_GIB * 2**30).fits
    return longest_context(fits, engine.chunk_size)


def plan_checked(rows: list[dict]) -> list[tuple[dict, float]]:
    """(row, measured peak ÷ planned_peak) for every shipped oomb step with its own peak that
    records where its engine placed the pages and kept outputs (kept_host_layers), at a preset's
    full depth, one document a sequence."""
    picked = [r for r in own_peaks(rows) if shipped(r, OFFLOAD.__contains__) and r.get("ok")
              and r.get("own_peak", True) and r.get("peak_gib") and "kept_host_layers" in r
              and r.get("layers") == PRESET_LAYERS.get(r.get("model", "qwen2.5-7b")) and not r.get("packed_docs")]
    return [(r, r["peak_gib"] * 2**30 / planned_peak(r)) for r in picked]


def auto_longest(r: dict) -> int:
    """The longest context `oomb train`'s automatic configuration reaches for an oomb-default row's
    model, gradients and attention at its GPU cap, with PLAN_HOST_GIB of host memory and AdamW's
    state counted (as oomb train plans): that of its most frugal setting (oomb.auto.frugal)."""
    from oomb.auto import Machine, frugal, judge
    from oomb.plan import longest_context

    config, engine, trainable = row_engine(r)
    machine = Machine(int(r["gpu_cap_gib"] * 2**30), PLAN_HOST_GIB * 2**30)
    least = frugal(engine.replace(keep_attention=None), r["seq_len"])
    args = {"trainable_params": trainable}
    return longest_context(lambda n: judge(config, n, 1, least, machine, args)[1].fits, least.chunk_size)


def planned_peak(r: dict) -> int:
    """The GPU bytes `oomb plan` gives the step an oomb row measured, placed as its engine placed it
    (the row's layers on the host and kept outputs on the GPU): weights, gradients (no optimizer:
    bench_step.py's step has none), one chunk's working set, sparse selections, the device layers'
    pages, staging buffers when layers are on the host, and the kept attention outputs on the GPU."""
    from oomb.plan import plan

    config, engine, trainable = row_engine(r)
    p = plan(config, r["seq_len"], engine=engine.replace(keep_attention=True), trainable_params=trainable,
             optimizer_bytes_per_param=0)
    host = r.get("host_layers") or 0
    kept_gpu = (r.get("kept_layers") or 0) - (r.get("kept_host_layers") or 0)
    return (p.beside_pages + p.window_pages + (p.full_layers - host) * p.layer_bytes + (p.staging if host else 0)
            + kept_gpu * p.kept_layer_bytes)
