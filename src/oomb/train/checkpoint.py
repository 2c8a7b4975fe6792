"""Checkpoints that are whole or absent: written to a temporary directory, then renamed.

    <output_dir>/step-000040/
        model.safetensors   trainable parameters (all of them, or the LoRA adapters)
        optimizer.pt        optimizer and scheduler state
        trainer.json        step, config
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, config) -> Path:
    final = Path(output_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(trainable_state(model), tmp / "model.safetensors")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "trainer.json").write_text(json.dumps({"step": step, "config": dataclasses.asdict(config)}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic: a reader sees the old checkpoint or the new one, never half
    return final


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
            params[name].copy_(tensor)
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    return json.loads((path / "trainer.json").read_text())["step"]
