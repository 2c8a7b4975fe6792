"""Optimizer state of tensor-parallel (DTensor) parameters as plain tensors, so that a checkpoint
holds tensors, numbers and strings only and loads with torch.load(weights_only=True): each
DTensor is saved as this rank's local tensor, and its placements, global shape and stride as
JSON; DTensor.from_local rebuilds it on the parameter's device mesh.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..parallel import is_dtensor


def local_state(state_dict: dict) -> tuple[dict, dict]:
    """An optimizer state_dict with each DTensor replaced by this rank's local tensor, and what
    DTensor.from_local needs to rebuild it: {"<param id>/<key>": {placements, shape, stride}}."""
    layouts, state = {}, {}
    for pid, entry in state_dict["state"].items():
        state[pid] = dict(entry)
        for key, value in entry.items():
            if is_dtensor(value):
                layouts[f"{pid}/{key}"] = {"placements": [_placement_json(p) for p in value.placements],
                                           "shape": list(value.shape), "stride": list(value.stride())}
                state[pid][key] = value.to_local()
    return {**state_dict, "state": state}, layouts


def with_dtensors(state_dict: dict, layouts: dict, optimizer, file: Path) -> dict:
    """local_state's inverse: each listed local tensor made a DTensor again, on the device mesh of
    the parameter it belongs to (ValueError when this run splits that parameter otherwise)."""
    if not layouts:
        return state_dict
    from torch.distributed.tensor import DTensor

    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = dict(zip(ids, [p for g in optimizer.param_groups for p in g["params"]]))
    for name, layout in layouts.items():
        pid, key = name.split("/", 1)
        param, local = params[int(pid)], state_dict["state"][int(pid)][key]
        placements = tuple(_placement(p) for p in layout["placements"])
        if not is_dtensor(param) or placements != tuple(param.placements):
            raise ValueError(f"checkpoint {file.parent}: {file.name} holds optimizer state split as "
                             f"{layout['placements']}, this run does not split that parameter so: resume with the "
                             "--tp it was written with")
        state_dict["state"][int(pid)][key] = DTensor.from_local(
            local.to(param.device), param.device_mesh, placements, run_check=False,
            shape=torch.Size(layout["shape"]), stride=tuple(layout["stride"]))
    return state_dict


def _placement_json(placement) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placement, Shard):
        return ["shard", placement.dim]
    assert isinstance(placement, Replicate), f"optimizer state placed as {placement}"
    return ["replicate"]


def _placement(spec: list):
    from torch.distributed.tensor import Replicate, Shard

    if spec == ["replicate"]:
        return Replicate()
    if len(spec) == 2 and spec[0] == "shard" and isinstance(spec[1], int):
        return Shard(spec[1])
    raise ValueError(f"unknown tensor placement {spec!r} in a checkpoint's optimizer state")
