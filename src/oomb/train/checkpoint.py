"""Checkpoints that are whole or absent: written to a temporary directory, then renamed.

    <output_dir>/step-000040/
        model.safetensors   trainable parameters (all of them, or the LoRA adapters)
        optimizer.pt        optimizer and scheduler state (optimizer-rank{r}.pt per rank under TP
                            and under ZeRO-1: each rank's share; resume with the same layout)
        trainer.json        step, config
    <output_dir>/final/     at the end: the trained model as transformers writes it
                            (AutoModelForCausalLM.from_pretrained), or the LoRA adapter as PEFT
                            does (PeftModel.from_pretrained on the base), plus the tokenizer
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole trainable tensors (tensor-parallel shards gathered: every rank must call this)."""
    return {n: _full(p.detach()).contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, config, write: bool = True) -> Path:
    """Every rank calls this (parameters are gathered); the rank with `write` writes the model.

    Under tensor parallelism and ZeRO-1 each rank writes its own optimizer state
    (`optimizer-rank{r}.pt`): nothing is gathered (a 7B model's AdamW state is 30 GB in bf16).
    """
    final = Path(output_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    state = trainable_state(model)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if write:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()  # the temporary directory exists before any rank writes into it
    if write:
        save_file(state, tmp / "model.safetensors")
        (tmp / "trainer.json").write_text(json.dumps({"step": step, "config": dataclasses.asdict(config)}, indent=2))
    zero = _is_zero(optimizer)
    per_rank = sharded or zero
    if per_rank or write:
        local = optimizer
        if zero:  # this rank's share, with the learning rate the scheduler set last
            local = optimizer.optim
            _copy_hyperparameters(optimizer.param_groups, local.param_groups)
        torch.save({"optimizer": local.state_dict(), "scheduler": scheduler.state_dict(), "ranks": _world()},
                   tmp / _optimizer_file(per_rank))
    _barrier()
    if write:
        _publish(tmp, final)
    _barrier()
    return final


def export(output_dir: str | Path, model, source: str, write: bool = True) -> Path:
    """The trained model (or adapter) in transformers / PEFT format under <output_dir>/final.

    Every rank calls this: tensor-parallel shards are gathered one parameter at a time and
    only the writing rank keeps them (host memory: one model, on one rank).
    """
    final = Path(output_dir) / "final"
    tmp = final.with_name(final.name + ".tmp")
    state = None
    if any(isinstance(p, DTensor) for p in model.parameters()):
        state = {}
        for name, tensor in model.state_dict().items():
            whole = _full(tensor)
            if write:
                state[name] = whole.cpu()
    if write:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)  # None: transformers reads the parameters shard by shard
        _save_tokenizer(source, tmp)
        _publish(tmp, final)
    _barrier()
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Put a fully written directory in place of `final` (a reader sees the old one or the new
    one, never half of either)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _save_tokenizer(source: str, path: Path) -> None:
    """The checkpoint's tokenizer beside the model (a preset has none)."""
    from transformers import AutoTokenizer

    from ..presets import PRESETS

    if source in PRESETS:  # random weights, no tokenizer (and no hub lookup of the name)
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        return
    tokenizer.save_pretrained(path)


def _optimizer_file(per_rank: bool) -> str:
    return f"optimizer-rank{dist.get_rank()}.pt" if per_rank else "optimizer.pt"


def _copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """ZeRO-1 shows one set of param_groups (the scheduler edits them) and steps a local
    optimizer that copies them at each step: keep the two alike around a checkpoint."""
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _is_zero(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(path: str | Path, model, optimizer, scheduler) -> int:
    """Restore a checkpoint written by save(); returns the step it was taken at."""
    path = Path(path)
    if not (path / "trainer.json").is_file():
        raise ValueError(f"--resume {str(path)!r} is not a checkpoint directory (no trainer.json in it)")
    state = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} trainable parameters, e.g. {missing[0]}; "
                         "was it written with the same model and LoRA settings?")
    with torch.no_grad():
        for name, tensor in state.items():
            p = params[name]
            if isinstance(p, DTensor):  # take this rank's shard of the whole tensor
                tensor = distribute_tensor(tensor.to(p.device), p.device_mesh, p.placements)
            p.copy_(tensor)
    sharded = any(isinstance(p, DTensor) for p in params.values())
    zero = _is_zero(optimizer)
    per_rank = sharded or zero
    file = path / _optimizer_file(per_rank)
    if not file.is_file():
        raise ValueError(f"checkpoint {path} has no {file.name}: it was written with another parallel layout; "
                         "resume with the --tp, process count and --shard-optimizer setting it was written with")
    # DTensor optimizer state is not a plain tensor: it loads only with full unpickling.
    opt = torch.load(file, map_location="cpu", weights_only=not sharded)
    if per_rank and opt.get("ranks") != _world():
        raise ValueError(f"checkpoint {path} holds the optimizer shards of {opt.get('ranks')} ranks, this run has "
                         f"{_world()}: resume with the number of processes it was written with")
    if zero:  # this rank's share, and the hyperparameters (lr) the wrapper shows
        optimizer.optim.load_state_dict(opt["optimizer"])
        _copy_hyperparameters(optimizer.optim.param_groups, optimizer.param_groups)
    else:
        optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    return json.loads((path / "trainer.json").read_text())["step"]
