"""Several GPUs on torch.distributed: data parallel (each rank its own sequences) and tensor
parallel (DTensor: attention heads and MLP columns split across ranks).

The engine is written for one device; parallelism is applied to the model afterwards, in
this one place (torchtitan's order: tensor parallel first, then data parallel):

  - tensor parallel: q/k/v/gate/up projections column-parallel, o/down row-parallel, so each
    rank computes its own query and KV heads and keeps the pages of its own KV heads (page
    memory and transfers divide by the TP degree). DTensor inserts every collective, including
    the all-reduce of the gradient that flows into the column-parallel inputs (the norms and
    the residual stream): the one hand-written TP code tends to miss.
  - data parallel: each rank runs its own sequences, the loss is normalised by the global token
    count, and gradients are summed across ranks once per step (bucketed all-reduce, as DDP
    does; DDP's module wrapper does not fit an engine that calls backward once per chunk).

Launch: `torchrun --nproc-per-node N -m oomb.cli train --tp T ...` (README).
"""
from __future__ import annotations

import functools
import math
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .models import adapter_for

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# torch.distributed.tensor (DTensor and its ops' registry: about 1 s of `import oomb` on a 2-core
# CPU) is imported by what shards a model; until then no tensor can be a DTensor.


def is_dtensor(t) -> bool:
    kind = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return kind is not None and isinstance(t, kind)


def world_size() -> int:
    """Processes of the run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Processes of the run on this machine (torchrun's LOCAL_WORLD_SIZE): they share its host
    memory and CPUs."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def init_distributed(tp: int = 1, timeout_s: float = 600.0) -> DeviceMesh:
    """Process group from torchrun's environment and a (dp, tp) mesh over all ranks. A
    collective that waits timeout_s for the other ranks fails the run (a rank died or hangs)
    instead of waiting for ever; every group of the run has that timeout."""
    world = world_size()
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} processes; use a divisor of {world}")
    cuda = torch.cuda.is_available()
    device = None
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # device_id binds NCCL to this rank's GPU (without it NCCL guesses from the global rank)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device, timeout=timeout)
    from torch.distributed.device_mesh import DeviceMesh

    # The mesh's groups made here: init_device_mesh gives new (gloo) groups torch's default timeout.
    ranks = torch.arange(world).reshape(world // tp, tp)  # (dp, tp)
    tp_group, _ = dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=timeout)
    dp_group, _ = dist.new_subgroups_by_enumeration(ranks.T.tolist(), timeout=timeout)
    return DeviceMesh.from_group([dp_group, tp_group], "cuda" if cuda else "cpu", mesh=ranks,
                                 mesh_dim_names=("dp", "tp"))


def host_group(timeout_s: float = 600.0):
    """Every rank, for a flag all-reduced on the host every chunk (the stop agreement): the world
    group under gloo; beside NCCL a gloo group, so that reading the result never waits for the
    GPU (an NCCL result is read after the GPU has run everything queued before it)."""
    if dist.get_backend() == "gloo":
        return None  # torch.distributed's name for the world group
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every decoder layer's attention heads and MLP columns over `tp_mesh` (in place)."""
    adapter = adapter_for(model)
    if adapter.tp_refusal:
        raise ValueError(f"tensor parallelism is not implemented for {type(adapter.causal_lm).__name__} "
                         f"({adapter.tp_refusal}); train it data-parallel (--tp 1)")
    size = tp_mesh.size()
    for name, count in (("num_attention_heads", adapter.n_heads), ("num_key_value_heads", adapter.n_kv_heads)):
        if count % size:
            raise ValueError(f"{name}={count} is not divisible by the tensor-parallel degree {size}; "
                             f"use a degree that divides {count}")
    for layer in adapter.layers:
        plan = {}
        for name, style in (("self_attn.q_proj", "col"), ("self_attn.k_proj", "col"), ("self_attn.v_proj", "col"),
                            ("self_attn.o_proj", "row"), ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"),
                            ("mlp.down_proj", "row")):
            plan.update(_linear_plan(layer, name, style))
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(layer, tp_mesh, plan)
        for name in adapter.per_head_modules:  # replicated weights applied to this rank's heads only
            for p in layer.get_submodule(name).parameters():
                p.register_hook(functools.partial(_sum_over, group=tp_mesh.get_group()))


def _sum_over(grad: torch.Tensor, group) -> torch.Tensor:
    """A gradient summed over the ranks of `group`: a weight shared by every head (a q/k norm's)
    gets from each rank only its own heads' share. Summed as each backward produces it (before it
    is accumulated), so accumulation over chunks and steps stays a plain sum."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _linear_plan(layer: nn.Module, name: str, style: str) -> dict:
    """Plan entries for one projection: the Linear itself, or a PEFT LoRA layer's pieces.

    LoRA (y = W x + B A x): column-parallel W shards its outputs, so B shards its outputs the
    same way and A stays whole (its input gradient is summed over ranks by DTensor at B's
    input); row-parallel W shards its inputs, so A shards its inputs (its partial outputs are
    all-reduced) and B stays whole. Every adapter weight then gets its exact gradient.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    parallel = ColwiseParallel if style == "col" else RowwiseParallel
    try:
        module = layer.get_submodule(name)
    except AttributeError:
        raise ValueError(f"tensor parallelism splits the attention and dense-MLP projections of a decoder layer; "
                         f"this model's layers have no {name}: train it data-parallel (--tp 1)") from None
    if isinstance(module, nn.Linear):
        return {name: parallel()}
    base = getattr(module, "base_layer", None)
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    extras = [n for n in ("lora_magnitude_vector", "lora_embedding_A") if getattr(module, n, None)]
    if not isinstance(base, nn.Linear) or lora_a is None or lora_b is None or extras:
        raise ValueError(f"tensor parallelism supports nn.Linear and PEFT LoRA on nn.Linear; {name} is "
                         f"{type(module).__name__}{' with ' + ', '.join(extras) if extras else ''}")
    plan = {f"{name}.base_layer": parallel()}
    sharded = lora_b if style == "col" else lora_a
    plan.update({f"{name}.{'lora_B' if style == 'col' else 'lora_A'}.{key}": parallel() for key in sharded})
    return plan


def global_token_count(labels: torch.Tensor, dp_group=None) -> int:
    """Predicted tokens over every data-parallel rank (the loss's denominator)."""
    count = (labels[:, 1:] != -100).sum().reshape(1).to(torch.int64)
    if dist.is_initialized():
        dist.all_reduce(count, group=dp_group)
    return int(count)


def all_reduce_gradients(model: nn.Module, dp_group=None, bucket_bytes: int = 256 * 2**20) -> None:
    """Sum every gradient over the data-parallel ranks, a flat bucket of tensors at a time."""
    if not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    bucket, size = [], 0
    for g in grads + [None]:
        if g is not None and (not bucket or (g.dtype == bucket[0].dtype and size < bucket_bytes)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = torch.cat([x.reshape(-1) for x in bucket])
            dist.all_reduce(flat, group=dp_group)
            offset = 0
            for x in bucket:
                x.copy_(flat[offset : offset + x.numel()].view_as(x))
                offset += x.numel()
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, tp_group=None) -> float:
    """torch.nn.utils.clip_grad_norm_ for a mix of tensor-parallel (sharded DTensor) and
    replicated gradients: shards' squares are summed over the TP group, replicas counted once.
    max_norm 0: no clipping, as transformers' max_grad_norm=0; the norm is returned all the same."""
    max_norm = max_norm or math.inf
    grads = [p.grad for p in params if p.grad is not None]
    if not any(is_dtensor(g) for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    sharded = [g for g in grads if is_dtensor(g) and any(pl.is_shard() for pl in g.placements)]
    replicated = [g for g in grads if not any(g is s for s in sharded)]
    device = local_tensor(grads[0]).device
    sq_sharded = sum((local_tensor(g).float().pow(2).sum() for g in sharded), torch.zeros((), device=device))
    dist.all_reduce(sq_sharded, group=tp_group)
    sq = sq_sharded + sum((local_tensor(g).float().pow(2).sum() for g in replicated), torch.zeros((), device=device))
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local_tensor(g).mul_(coef.to(g.dtype))
    return float(norm)
