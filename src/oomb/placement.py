"""Where a step's pages and kept attention outputs live: one pure function of plain numbers.

`place()` takes sizes and budgets (no tensors, no devices, no measuring) and decides how many
full-attention layers keep their pages on the GPU, whether host layers need staging buffers, and
how many layers' attention outputs stage 1 keeps on the GPU and in pinned host memory. The engine
calls it at every step's start with the memory it measured at the first (memory/step.py),
`oomb plan` with the memory it is told (plan.py): the plan describes the step the engine runs, and
the automatic configuration searches over it.

Offload 'none' keeps every layer's pages on the GPU, 'all' puts the full-attention layers' pages
on the host, 'auto' keeps whole layers on the GPU while they fit beside the staging buffers. Sliding-
window layers' few pages always stay on the GPU. Kept attention outputs go to the GPU as far as the
room left beside the pages holds them, the rest to pinned host memory within its budget.
"""
from __future__ import annotations

from dataclasses import dataclass


OFFLOAD_MODES = ("none", "all", "auto")


@dataclass(frozen=True)
class PlacementInput:
    """A step's sizes and budgets, in bytes (the engine's and the plan's, alike)."""

    offload: str  # 'none', 'all' or 'auto'
    full_layers: int  # layers whose pages may go to the host
    layer_bytes: int  # one full layer's pages for the step: K, V, dK, dV and sparse representatives
    window_bytes: int = 0  # the sliding-window layers' pages (always on the GPU)
    staging_bytes: int = 0  # device buffers a step with host layers stages their pages in
    gpu_room: int | None = None  # device bytes free for all of the above and kept outputs (None: no limit)
    held_bytes: int = 0  # device page bytes already allocated, counted in gpu_room (the engine's pool only
    # grows: a step shorter than an earlier one still holds the longer one's pages)
    page_budget: int | None = None  # 'auto': device bytes the full layers' pages may take, as given
    kept_layers: int = 0  # layers whose attention outputs the step would keep, in order of preference
    kept_gpu_bytes: int = 0  # one such layer's outputs on the GPU
    kept_host_bytes: int = 0  # one such layer's outputs in the pinned host arena
    kept_host_budget: int | None = None  # pinned host bytes kept outputs may take (None: no limit)
    keep_all: bool = False  # keep_attention=True: every kept layer or an error

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload={self.offload!r} is not one of {OFFLOAD_MODES}")


@dataclass(frozen=True)
class Placement:
    """The decision: the first `device_layers` full layers keep their pages on the GPU, the other
    `host_layers` on the host; the first `kept_gpu` kept layers' outputs on the GPU, the next
    `kept_host` on the host (the rest are not kept)."""

    device_layers: int
    host_layers: int
    staging: int  # device staging bytes (0 without host layers)
    kept_gpu: int
    kept_host: int
    gpu_bytes: int  # device bytes of pages, staging and kept outputs
    host_bytes: int  # pinned host bytes of pages and kept outputs

    @property
    def kept(self) -> int:
        return self.kept_gpu + self.kept_host


def place(x: PlacementInput) -> Placement:
    """The placement of one step (see the module's docstring); raises ValueError when
    keep_all asks for more kept outputs than the room and the host budget hold."""
    n = x.full_layers
    if x.offload == "none":
        on_gpu = n
    elif x.offload == "all":
        on_gpu = 0
    elif x.layer_bytes == 0:
        on_gpu = n
    else:
        budget = x.page_budget
        if budget is None:
            budget = _INF if x.gpu_room is None else x.gpu_room - x.window_bytes - x.staging_bytes
        on_gpu = min(n, max(0, budget) // x.layer_bytes)
    on_host = n - on_gpu
    staging = x.staging_bytes if on_host else 0
    gpu = max(x.window_bytes + on_gpu * x.layer_bytes, x.held_bytes) + staging
    host = on_host * x.layer_bytes

    kept_gpu = kept_host = 0
    if x.kept_layers:
        if x.gpu_room is not None and x.kept_gpu_bytes:
            kept_gpu = min(x.kept_layers, max(0, x.gpu_room - gpu) // x.kept_gpu_bytes)
        rest = x.kept_layers - kept_gpu
        kept_host = rest
        if x.kept_host_budget is not None and x.kept_host_bytes:
            kept_host = min(rest, x.kept_host_budget // x.kept_host_bytes)
        if x.keep_all and kept_host < rest:
            raise ValueError(
                f"keep_attention=True: the attention outputs of {rest} layers need "
                f"{human_bytes(rest * x.kept_host_bytes)} of pinned host memory ({kept_gpu} more layers' fit on "
                f"the GPU beside the pages), but the budget is {human_bytes(x.kept_host_budget)}: {kept_host} "
                "layers would fit. Use keep_attention=None (keeps as many layers as fit), a larger "
                "kept_host_bytes, or keep_attention=False")
    return Placement(on_gpu, on_host, staging, kept_gpu, kept_host,
                     gpu + kept_gpu * x.kept_gpu_bytes, host + kept_host * x.kept_host_bytes)


def human_bytes(n: float) -> str:
    """'1.5 GiB', '12.0 MiB', '512 B': for messages a person reads."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


_INF = 2**62
