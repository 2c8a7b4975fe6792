"""What an engine is made of, in one frozen value: `EngineConfig` (and its `KernelOptions`,
defined beside the kernels they switch, attention/options.py).

The engine, the trainer (`oomb.train.trainer.engine_config`) and `oomb plan` build from the same
EngineConfig, so the plan describes the step the engine runs. The library never reads the
environment: the command line and the benchmarks call `KernelOptions.from_env(os.environ)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .attention import BACKENDS
from .attention.options import KernelOptions
from .attention.policy import SparsePolicy, check_policy
from .placement import OFFLOAD_MODES


@dataclass(frozen=True)
class EngineConfig:
    """Everything ChunkRecurrentEngine is configured by (the model aside).

    chunk_size, page_size: tokens per chunk (the unit of recomputation: its activations are all
    a step keeps) and per page (the unit of K/V storage); chunk_size a multiple of page_size.
    backend: 'triton' (CUDA kernels), 'torch' (plain PyTorch: CPU, and the tests' oracle) or 'auto'.
    offload: where the full-attention layers' pages live: 'none' (GPU), 'all' (pinned host
    memory) or 'auto' (whole layers on the GPU while they fit, the rest on the host).
    sparse: a SparsePolicy (attention/policy.py): TopKPages(budget=...) for page-level top-k
    attention; None for dense.
    kv_grad_dtype: the dK/dV pages' dtype (float32, bfloat16: half the bytes), or None for an
    evaluation-only engine (pages without dK/dV).
    group_pages: a layer's earlier pages are attended (and a dense host layer's staged) this
    many at a time.
    gpu_page_budget_bytes: 'auto' may put this many page bytes on the GPU (None: measured at
    the first step).
    checkpoint_layers: stage 2 keeps each layer's input only and recomputes the layer in
    backward (minimum memory, ~+25 % compute).
    reserved_gpu_bytes: device memory the caller allocates later (optimizer state): 'auto'
    leaves it free.
    compile_layers: torch.compile the decoder layers (and the head's cross entropy).
    param_grad_dtype: sum each parameter's chunk gradients in this dtype (float32), None: in
    the parameter's own.
    keep_attention: stage 1 keeps attention outputs for stage 2: True every layer, None as
    many as fit, False none.
    kept_host_bytes: pinned host bytes kept attention outputs may take (None: half the free).
    local_world_size: processes sharing this machine's host memory and CPUs (torchrun's
    LOCAL_WORLD_SIZE; oomb.parallel passes it).
    kernels: KernelOptions.
    """

    chunk_size: int = 4096
    page_size: int = 128
    backend: str = "auto"
    offload: str = "none"
    sparse: SparsePolicy | None = None
    kv_grad_dtype: torch.dtype | None = torch.float32
    group_pages: int = 1024
    gpu_page_budget_bytes: int | None = None
    checkpoint_layers: bool = False
    reserved_gpu_bytes: int = 0
    compile_layers: bool = False
    param_grad_dtype: torch.dtype | None = None
    keep_attention: bool | None = False
    kept_host_bytes: int | None = None
    local_world_size: int = 1
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size", "group_pages", "local_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TypeError(f"{name} must be a positive int, got {value!r}")
        if self.chunk_size % self.page_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} is not a multiple of page_size={self.page_size}; "
                f"use chunk_size={max(1, round(self.chunk_size / self.page_size)) * self.page_size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}; 'auto' picks triton on CUDA, "
                             "torch elsewhere")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload={self.offload!r} is not one of {OFFLOAD_MODES}")
        if self.sparse is not None:
            check_policy(self.sparse)
        if self.kv_grad_dtype not in (torch.float32, torch.bfloat16, None):
            raise ValueError(f"kv_grad_dtype={self.kv_grad_dtype} must be torch.float32, torch.bfloat16 or None "
                             "(evaluation only: pages without dK/dV, a third of the memory with fp32)")
        wide = self.param_grad_dtype
        if wide is not None and not (isinstance(wide, torch.dtype) and wide.is_floating_point
                                     and torch.finfo(wide).bits >= 32):
            raise ValueError(f"param_grad_dtype={wide} must be None (each parameter's own dtype) "
                             "or a float of 32 bits or more (torch.float32)")
        for name in ("kept_host_bytes", "gpu_page_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} must be None (decided from the free memory) or bytes >= 0")
        if isinstance(self.reserved_gpu_bytes, bool) or not isinstance(self.reserved_gpu_bytes, int) \
                or self.reserved_gpu_bytes < 0:
            raise ValueError(f"reserved_gpu_bytes={self.reserved_gpu_bytes!r} must be bytes >= 0")
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"kernels={self.kernels!r} must be an oomb.KernelOptions")
        if self.keep_attention is not None:
            object.__setattr__(self, "keep_attention", bool(self.keep_attention))
        object.__setattr__(self, "checkpoint_layers", bool(self.checkpoint_layers))
        object.__setattr__(self, "compile_layers", bool(self.compile_layers))

    def replace(self, **changes) -> "EngineConfig":
        """A copy with `changes` (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_size // self.page_size
