"""Where a step's pages live and what else it keeps, decided at the step's start.

Offload 'none' keeps every layer's pages on the GPU, 'all' puts the full-attention layers' pages
on the host, 'auto' keeps as many layers on the GPU as fit in a budget fixed at the first step
(free memory less what the step still needs: one chunk's working set from plan(), parameter
gradients not allocated yet, `reserved_gpu_bytes`, a margin). Stage 1's attention outputs are kept
(keep_attention=None) when they fit beside the pages. A step that cannot fit is refused before
anything is computed, with what would fit and how to get there.
"""
from __future__ import annotations

import torch

from .memory.offload import available_host_bytes
from .plan import GPU_MARGIN_BYTES, human_bytes, kept_attention_bytes, plan


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
        self.keeps_attention = training and self._keeps(batch, max_pages)  # evaluate() keeps nothing
        self._check_memory(batch, max_pages, len(full) - n_device, layer_bytes)
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

    def _keeps(self, batch: int, max_pages: int) -> bool:
        """Whether this step keeps stage 1's attention outputs: as asked, or (None) when they fit
        beside the pages (offload 'none'; on the GPU, with what the step still needs)."""
        if self.keep_attention is not None:
            return self.keep_attention
        if self.offload != "none":
            return False
        kept = self._attention_bytes(batch, max_pages)
        if self.device.type != "cuda":
            return kept <= available_host_bytes() // 4
        return self.store.device_bytes(batch, max_pages) + kept <= self._headroom()  # the room counts the pool

    def _free_budget(self) -> int:
        staging = 2 * self.store.host.group_pages * self.spec.page_bytes
        return max(0, self._headroom() - staging)

    def _headroom(self) -> int:
        """Device bytes free for pages (and kept attention) now: free memory and this engine's own
        pool, less one chunk's working set, what is still to come (parameter gradients not
        allocated yet, `reserved_gpu_bytes`) and a margin."""
        reusable = self.store.pool.n_slots * self.spec.page_bytes  # this engine's own pool
        trainable = None if self.adapter.embed_tokens.weight.requires_grad else 0
        working_set = plan(self.adapter.config, self.chunk_size, chunk_size=self.chunk_size, page_size=self.page_size,
                           dtype=self.spec.dtype, trainable_params=trainable,
                           checkpoint_layers=self.checkpoint_layers,
                           n_params=sum(p.numel() for p in self.model.parameters())).working_set
        summed = set(self.summed_params())  # their sums, not their .grad, take the room during the step
        grads = sum(p.numel() * p.element_size() for p in self.model.parameters()
                    if p.requires_grad and p.grad is None and p not in summed)
        grads += sum(p.numel() * torch.finfo(self.param_grad_dtype).bits // 8 for p in summed)
        later = grads + self.reserved_gpu_bytes
        return self._free_gpu_bytes() + reusable - working_set - later - GPU_MARGIN_BYTES

    def _free_gpu_bytes(self) -> int:
        """Free device memory, counting what the caching allocator holds but does not use."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def _check_memory(self, batch: int, max_pages: int, n_host: int, layer_bytes: int) -> None:
        pool_now = self.store.pool.n_slots * self.spec.page_bytes
        host_pages = n_host * layer_bytes  # the host arena's pages
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
        """Device bytes of the attention outputs and LSEs stage 1 keeps (keep_attention), of this
        rank's query heads."""
        return self._attention_bytes(batch, max_pages) if self.keeps_attention else 0

    def _attention_bytes(self, batch: int, max_pages: int) -> int:
        """What keeping the attention outputs and LSEs takes (this rank's query heads)."""
        a = self.adapter
        heads = a.local_kv_heads * (a.n_heads // a.n_kv_heads)
        return kept_attention_bytes(max_pages // (self.chunk_size // self.page_size), a.n_layers, batch,
                                    self.chunk_size, heads, a.head_dim, self.spec.dtype.itemsize)
