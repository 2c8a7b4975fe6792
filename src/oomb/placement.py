"""Where a step's pages live and what else it keeps, decided at the step's start.

Offload 'none' keeps every layer's pages on the GPU, 'all' puts the full-attention layers' pages
on the host, 'auto' keeps as many layers on the GPU as fit in a budget fixed at the first step
(free memory less what the step still needs: one chunk's working set from plan(), parameter
gradients not allocated yet, `reserved_gpu_bytes`, a margin). Stage 1's attention outputs are kept
(keep_attention) on the GPU when they fit beside the pages, else in pinned host memory within a
budget. A step that cannot fit is refused before
anything is computed, with what would fit and how to get there.
"""
from __future__ import annotations

import os

import torch

from .memory.kept import KeptAttention
from .memory.offload import available_host_bytes
from .parallel import local_tensor
from .plan import GPU_MARGIN_BYTES, human_bytes, kept_attention_bytes, plan

HOST_MARGIN_BYTES = 4 * 2**30  # host memory kept attention outputs leave free (the process, the OS)


class PagePlacement:
    """The engine's memory decisions (ChunkRecurrentEngine inherits them; they read its store,
    adapter, model and settings)."""

    def _begin_step(self, batch: int, max_pages: int, training: bool = True) -> None:
        self._selection.clear()  # the last step's sparse selections (kept until now for inspection)
        layer_bytes = batch * max_pages * self.store.layer_page_bytes  # one full layer's pages for the step
        # Windowed layers' few pages always stay on the device; full layers may go to the host.
        full = [i for i in range(self.adapter.n_layers) if i not in self.store.tail_pages]
        if self.offload == "none":
            n_device = len(full)
        elif self.offload == "all":
            n_device = 0
        else:
            n_device = len(full) if layer_bytes == 0 else min(len(full), self._page_budget() // layer_bytes)
        self.store.place(full[n_device:])
        host_pages = (len(full) - n_device) * layer_bytes  # the host arena's pages
        self._place_kept(batch, max_pages, host_pages, training)  # evaluate() keeps nothing
        self._check_memory(batch, max_pages, host_pages)
        self.store.begin_step(batch, max_pages)

    def _page_budget(self) -> int:
        """Device bytes pages may take under offload 'auto'.

        Decided once, at the first step (or reserve()): what is free then, less what is
        still to come (parameter gradients not allocated yet, `reserved_gpu_bytes`), one
        chunk's working set and a margin. Fixed afterwards, so every step places its pages
        the same way and the pinned host arena is reused, not re-pinned.
        """
        if self.gpu_page_budget_bytes is not None:
            return self.gpu_page_budget_bytes
        if self._budget is None:  # a CPU model: host and "device" are the same memory
            self._budget = self._free_budget() if self.device.type == "cuda" else 2**62
        return self._budget

    def _place_kept(self, batch: int, max_pages: int, host_pages: int, training: bool) -> None:
        """Which layers' attention outputs stage 1 keeps this step, and where: every layer but the
        last (stage 1 stops at its K/V), full-attention layers first (a window's attention is
        cheap to recompute); on the GPU as many layers as fit beside the pages, the others in
        pinned host memory, as many as the host budget holds (keep_attention=True: all, or an
        error before anything is computed)."""
        a = self.adapter
        n_chunks = max_pages // (self.chunk_size // self.page_size)  # stored chunks
        heads = a.local_kv_heads * (a.n_heads // a.n_kv_heads)
        layers = sorted(range(a.n_layers - 1), key=lambda i: (bool(a.window(i)), i))
        if not training or self.keep_attention is False or n_chunks == 0:
            layers = []
        n_gpu = 0
        if layers and self.device.type == "cuda":  # the room counts the pool; a CPU model keeps in "host" memory
            room = self._headroom() - self.store.device_bytes(batch, max_pages)
            n_gpu = min(len(layers), max(0, room) // max(1, self._attention_bytes(batch, max_pages, 1)))
        if n_gpu < len(layers):
            entry = KeptAttention.entry_bytes(batch, self.chunk_size, heads, a.head_dim, self.spec.dtype.itemsize)
            budget = self._kept_host_budget(host_pages)
            rest = len(layers) - n_gpu
            n = rest
            while n and KeptAttention.host_bytes(n * n_chunks, entry) > budget:
                n -= 1
            if self.keep_attention and n < rest:
                need = KeptAttention.host_bytes(rest * n_chunks, entry)
                raise ValueError(
                    f"keep_attention=True: the attention outputs of {rest} layers x {n_chunks} chunks need "
                    f"{human_bytes(need)} of pinned host memory ({n_gpu} more layers' fit on the GPU beside the "
                    f"pages), but the budget is {human_bytes(budget)}: {n} layers would fit. Use "
                    "keep_attention=None (keeps as many layers as fit), a larger kept_host_bytes, or "
                    "keep_attention=False")
            layers = layers[: n_gpu + n]
        self.kept.begin_step(layers, layers[n_gpu:], n_chunks, (batch, heads, self.chunk_size, a.head_dim),
                             self.spec.dtype)

    @property
    def keeps_attention(self) -> bool:
        """Whether this step keeps stage 1's attention outputs (of kept.layers; kept.host_layers'
        on the host)."""
        return bool(self.kept.layers)

    def _kept_host_budget(self, host_pages: int) -> int:
        """Host bytes kept attention outputs may pin: kept_host_bytes as given (a virtual machine
        may report less free memory than it can grow to), or (None) half of what is free besides
        this step's page arena less a margin, shared among the ranks of this host, decided at the
        first step so that every step keeps the same layers and the arena is pinned once."""
        if self.kept_host_bytes is not None:
            return self.kept_host_bytes
        if self._kept_budget is None:
            pinned = self.kept.arena_bytes + self.store.host.host_bytes(self.store.host.batch,
                                                                        self.store.host.max_pages)
            free = max(0, available_host_bytes() + pinned - host_pages - HOST_MARGIN_BYTES)
            self._kept_budget = free // (2 * int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return self._kept_budget

    def _free_budget(self) -> int:
        staging = 2 * self.store.host.group_pages * self.spec.page_bytes
        return max(0, self._headroom() - staging)

    def _headroom(self) -> int:
        """Device bytes free for pages (and kept attention) now: free memory and this engine's own
        pool, less one chunk's working set, what is still to come (parameter gradients not
        allocated yet, `reserved_gpu_bytes`) and a margin."""
        a = self.adapter
        reusable = self.store.pool.n_slots * self.spec.page_bytes  # this engine's own pool
        trainable = None if a.embed_tokens.weight.requires_grad else 0
        working_set = plan(a.config, self.chunk_size, chunk_size=self.chunk_size, page_size=self.page_size,
                           dtype=self.spec.dtype, trainable_params=trainable,
                           checkpoint_layers=self.checkpoint_layers, compiled=self.compile_layers,
                           tp=a.n_kv_heads // a.local_kv_heads,
                           n_params=sum(local_tensor(p).numel() for p in self.model.parameters())).working_set
        summed = set(self.summed_params())  # their sums, not their .grad, take the room during the step
        grads = sum(local_tensor(p).numel() * p.element_size() for p in self.model.parameters()
                    if p.requires_grad and p.grad is None and p not in summed)
        grads += sum(local_tensor(p).numel() * torch.finfo(self.param_grad_dtype).bits // 8 for p in summed)
        later = grads + self.reserved_gpu_bytes
        return self._free_gpu_bytes() + reusable - working_set - later - GPU_MARGIN_BYTES

    def _free_gpu_bytes(self) -> int:
        """Free device memory, counting what the caching allocator holds but does not use."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def _check_memory(self, batch: int, max_pages: int, host_pages: int) -> None:
        pool_now = self.store.pool.n_slots * self.spec.page_bytes
        host_need = host_pages - self.store.host.host_bytes(self.store.host.batch, self.store.host.max_pages)
        if self.device.type == "cpu":  # a CPU model's "device" pool (and staging) is host memory too
            host_pages += self.store.device_pages(batch, max_pages) * self.spec.page_bytes
            host_need += self.store.device_bytes(batch, max_pages) - pool_now
        if host_need > 0:
            available = available_host_bytes()
            if host_need > available:
                tokens = max(1, batch * max_pages * self.page_size)
                per_token = host_pages / tokens
                raise ValueError(
                    f"this step needs {human_bytes(host_need)} more host memory for its pages "
                    f"({human_bytes(per_token)} per token of context), but only {human_bytes(available)} is "
                    f"available: about {int(available / per_token):,} tokens would fit. Use a shorter context, "
                    "kv_grad_dtype=torch.bfloat16 (halves the gradient pages), offload='auto' (keeps part on the "
                    "GPU) or sparse attention."
                )
        if self.device.type == "cuda" and self.offload != "auto":
            kept = self._kept_bytes(batch, max_pages)
            need = self.store.device_bytes(batch, max_pages) - pool_now + kept
            free = self._free_gpu_bytes()
            if need > free:
                also = f" (of which {human_bytes(kept)} for keep_attention: leave it off)" if kept else ""
                raise ValueError(
                    f"the pages of this step need {human_bytes(need)} more GPU memory{also}, {human_bytes(free)} "
                    f"is free; use offload='auto' or offload='all' (pages on the host), a shorter context or "
                    "kv_grad_dtype=torch.bfloat16"
                )

    def _kept_bytes(self, batch: int, max_pages: int) -> int:
        """Device bytes of the attention outputs and LSEs stage 1 keeps on the GPU (keep_attention),
        of this rank's query heads."""
        return self._attention_bytes(batch, max_pages, len(self.kept.layers) - len(self.kept.host_layers))

    def _attention_bytes(self, batch: int, max_pages: int, n_layers: int | None = None) -> int:
        """What keeping the attention outputs and LSEs of n_layers (default: every layer but the
        last) takes (this rank's query heads)."""
        a = self.adapter
        heads = a.local_kv_heads * (a.n_heads // a.n_kv_heads)
        n_layers = a.n_layers - 1 if n_layers is None else n_layers
        return kept_attention_bytes(max_pages // (self.chunk_size // self.page_size), n_layers, batch,
                                    self.chunk_size, heads, a.head_dim, self.spec.dtype.itemsize)
