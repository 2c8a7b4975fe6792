"""The two-stage chunk-recurrent step.

    chunk 0 .. n-2                     stage 1, no autograd: run every layer, store each
      -> layers -> pages               layer's post-RoPE K/V in pages, attend over the
                                       earlier pages + the chunk itself
    chunk n-1 .. 0                     stage 2: recompute the chunk with autograd (reading
      -> layers (autograd) -> loss     the earlier pages), LM head + CE a slice at a time,
      -> backward                      backward; attention adds dK/dV of earlier pages into
      -> free the chunk's pages        their gradient pages, and the chunk's own dK/dV gets
                                       what later chunks accumulated for it
Every term of the full-sequence gradient is computed once, so gradients equal ordinary
training up to rounding. Only one chunk's activations are alive at any time. The last chunk
needs no stage 1: nothing after it reads its pages.

The step's memory is sized, measured and checked in memory/step.py (placed by placement.py), and
its page transfers and the host thread's lead over the GPU are timed in memory/schedule.py.
"""
from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import attention_with_lse, paged_attention, resolve_backend
from .attention.documents import Documents, check_positions, documents
from .config import EngineConfig
from .grad_sums import GradSums, summed_params
from .loss import IGNORE_INDEX, ce_and_grad, head_loss, head_token_losses, shifted_targets, slice_tokens
from .memory.kept import KeptAttention
from .memory.schedule import HostLead, LookAhead
from .memory.spec import KVShape, ScheduledGroups, Selection
from .memory.step import StepMemory
from .memory.store import PagedKVStore
from .models import adapter_for
from .placement import PlacementInput, place


@dataclass
class StepResult:
    loss: torch.Tensor  # fp32 scalar: sum of CE over predicted tokens / num_tokens
    num_tokens: int  # predicted (non-ignored) tokens, over the whole batch
    # evaluate(per_token=True): (B, T) fp32, entry p the cross entropy of token p predicted from
    # tokens < p (NaN where nothing is predicted: p = 0 and labels of -100), and (B, T) int64, entry p
    # the argmax prediction for token p (-1 at p = 0)
    token_losses: torch.Tensor | None = None
    predictions: torch.Tensor | None = None


class Probe(Protocol):
    """Called by evaluate(probe=...) for each chunk and layer, after the layer's projections and
    before its attention: chunk c, layer i, the chunk's post-RoPE queries q (B, H, C, D) and keys
    k (B, Hkv, C, D), the sparse policy's Selection of the earlier pages (None for a dense layer)
    and `earlier_keys()`, which copies the layer's earlier keys (B, Hkv, n * P, D) to the device."""

    def __call__(self, c: int, i: int, q: torch.Tensor, k: torch.Tensor, selection: Selection | None,
                 earlier_keys: Callable[[], torch.Tensor]) -> None: ...


class ChunkRecurrentEngine:
    """Computes loss and parameter gradients of a causal LM on long sequences, chunk by chunk.

    The engine only computes gradients (accumulated into each parameter's .grad, exactly as
    `loss.backward()` would); the optimizer and the data belong to the caller.

    group_pages: a layer's earlier pages are attended this many at a time, and a dense host
    layer's staged this many at a time (two buffers: up to 1.5 GiB at the 7B shape, fp32 dK/dV);
    every offload mode groups alike, so their gradients are bitwise equal. Fewer, larger calls
    are faster for dense attention: 1024 against 128, -1.5 % at 64K and -3 % at 128K tokens on
    an H200, and with every page on the host ('all') within 0.2 % of 'none' since a host
    layer's first group loads during the layer before it (H200, 2026-12-01, fda5ef3; docs/experiments.md).
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, **options) -> None:
        """config: an EngineConfig; or its fields as keyword arguments (chunk_size=..., offload=...)."""
        if config is None:
            config = EngineConfig(**options)
        elif options:
            config = config.replace(**options)
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an oomb.EngineConfig, got {type(config).__name__}")
        self.config = config
        chunk_size, page_size, sparse = config.chunk_size, config.page_size, config.sparse
        self.model = model
        self.adapter = adapter_for(model)
        self.chunk_size, self.page_size, self.sparse = chunk_size, page_size, sparse
        weight = self.adapter.embed_tokens.weight
        self.device = weight.device
        self.backend = resolve_backend(config.backend, self.device, config.kernels)
        # Stage 1 keeps attention outputs and LSEs so that stage 2 does not compute them again
        # (memory/kept.py), on the GPU or in pinned host memory (placement.py decides, each step).
        self.kept = KeptAttention(self.device, config.local_world_size)
        self._fused_ce = None  # the LM head's cross entropy and its gradient, fused (loss.ce_and_grad)
        if config.compile_layers:  # torch.compile fuses the norms, RoPE, MLP and residuals around attention
            self.adapter.compile()
            if self.adapter.local_kv_heads == self.adapter.n_kv_heads:  # not under TP: plain tensors
                self._fused_ce = torch.compile(ce_and_grad, dynamic=False)
        self._seq_len = 0  # of the step being computed
        self._docs: Documents | None = None  # its packed documents (position_ids), or None
        self._first_pages: list[int] = []  # packed: per chunk, the first page its queries can see
        # The K/V memory's layers and sizes, as the store, offload, the step's memory and the plan read them
        self.shape = KVShape.from_adapter(self.adapter, config, weight.dtype)
        self.spec = self.shape.page
        self.store = PagedKVStore(self.shape, self.device, sparse, copy_engines=config.kernels.copy_engines,
                                  local_world_size=config.local_world_size)
        # Sparse: (chunk, layer) -> the pages it reads, chosen once, used by both stages
        self._selection: dict[tuple[int, int], Selection] = {}
        self._dense_layers = sparse.dense_set(self.adapter.n_layers) if sparse is not None else frozenset()
        self._rope_keys = [self.adapter.rope_key(i) for i in range(self.adapter.n_layers)]  # _layer_ropes()
        self._probe: Probe | None = None  # evaluate(probe=...)
        # The steps' sizes, the memory measured for them at the first step, and the check
        # before each (memory/step.py)
        self.memory = StepMemory(model, self.adapter, self.store, self.kept, self.device)

    # -- the step -----------------------------------------------------------------------------

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                         num_tokens: int | None = None, progress=None,
                         position_ids: torch.Tensor | None = None) -> StepResult:
        """Loss of `model(input_ids, labels=labels)` and its gradients, accumulated into .grad.

        input_ids: (B, T) integer token ids, T >= 2. labels: (B, T), default input_ids;
        IGNORE_INDEX (-100) is not predicted; shifted by one as in transformers.
        num_tokens: normalise by this count instead of this batch's predicted tokens (for
        gradient accumulation over micro-batches or ranks: pass the global count).
        progress: called as progress(done, total) after each chunk pass (stage 1's n - 1, then
        stage 2's n), from the host thread as it queues work (no GPU sync).
        position_ids: (B, T) packed documents, as transformers' DataCollatorWithFlattening makes
        them: a document starts wherever they restart at 0 and counts up by 1 a token. Each token
        attends only to the tokens of its own document up to itself, and RoPE rotates it by its
        position in the document (as that document alone). No loss term crosses a boundary: the
        label of a document's first token (position 0) is never predicted, whatever `labels`
        hold there (the collator writes -100 there; labels without it are masked the same), and
        is not counted in num_tokens. The loss and gradients are those of the documents trained
        one by one, summed, over the batch's count. None: every sequence is one document.
        """
        if not self.spec.grads:
            raise ValueError("this engine was made with kv_grad_dtype=None (evaluation only: its pages have no "
                             "dK/dV); use evaluate(), or make the engine with kv_grad_dtype=torch.float32 to train")
        input_ids, labels, count, bounds = self._prepare(input_ids, labels, position_ids)
        batch = input_ids.shape[0]
        denominator = count if num_tokens is None else num_tokens
        self.adapter.check_trainable()
        pages_per_chunk = self.config.pages_per_chunk
        self._begin_step(batch, (len(bounds) - 1) * pages_per_chunk)
        rng_states = []
        lead = HostLead(self.device)
        passes = _Passes(progress, 2 * len(bounds) - 1)
        sums = GradSums(self.summed_params(), self.config.param_grad_dtype)
        try:
            with torch.no_grad():
                self._stage1(input_ids, bounds, rng_states, lead, passes)
            rng_states.append(self._rng_state())
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for c in reversed(range(len(bounds))):
                start, end = bounds[c]
                with torch.random.fork_rng(self._rng_devices()):
                    self._set_rng_state(rng_states[c])
                    total += self._stage2_chunk(c, input_ids[:, start:end], start,
                                                shifted_targets(labels, start, end), denominator,
                                                last=c == len(bounds) - 1,
                                                backward=sums.finishing if c == 0 else contextlib.nullcontext)
                if c < len(bounds) - 1:
                    self.store.free_chunk(c)
                self.kept.drop(c)
                lead.chunk_done()
                passes.done()
        finally:
            sums.close()
            self.kept.clear()
            self.store.free_all()
        return StepResult(loss=total / denominator, num_tokens=count)

    def pinned_bytes(self) -> int:
        """Pinned host memory this engine holds: the host pages' arena and kept attention outputs."""
        return self.memory.pinned_bytes()

    def summed_params(self) -> list[nn.Parameter]:
        """The trainable parameters whose chunk gradients are summed in param_grad_dtype."""
        return summed_params(self.model, self.config.param_grad_dtype)

    def reserve(self, batch: int, seq_len: int) -> None:
        """Allocate the page pool (and pinned host arena) for steps up to (batch, seq_len) now,
        so the first step does not pay for it (pinning runs at ~12.8 GB/s on the H200 machine,
        bench/bench_pin.py)."""
        n_chunks = -(-seq_len // self.chunk_size)
        self._begin_step(batch, (n_chunks - 1) * self.config.pages_per_chunk)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, progress=None,
                 per_token: bool = False, probe: Probe | None = None,
                 position_ids: torch.Tensor | None = None) -> StepResult:
        """Loss only (no gradients): one stage-1 pass over every chunk, LM head included;
        progress(done, total) after each chunk. per_token: also each token's cross entropy and
        argmax prediction (StepResult.token_losses, .predictions; NaN at a document's first
        token). probe: see Probe (diagnostics such as top-k selection recall; it reads, never
        changes, what the step computes). position_ids: packed documents, as forward_backward's."""
        input_ids, labels, count, bounds = self._prepare(input_ids, labels, position_ids)
        batch, seq_len = input_ids.shape
        pages_per_chunk = self.config.pages_per_chunk
        self._begin_step(batch, (len(bounds) - 1) * pages_per_chunk, training=False)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        token_losses = predictions = None
        if per_token:
            token_losses = torch.full((batch, seq_len), float("nan"), dtype=torch.float32, device=self.device)
            predictions = torch.full((batch, seq_len), -1, dtype=torch.long, device=self.device)
        lead = HostLead(self.device)
        passes = _Passes(progress, len(bounds))
        self._probe = probe
        try:
            for c, (start, end) in enumerate(bounds):
                last = c == len(bounds) - 1
                if not last:
                    self.store.alloc_chunk(c, c * pages_per_chunk, pages_per_chunk)
                h = self._stage1_chunk(c, input_ids[:, start:end], start, store=not last, full=True)
                targets = shifted_targets(labels, start, end)
                step = slice_tokens(self.adapter.vocab_size, batch)
                if per_token:  # position start + j predicts token start + j + 1
                    ce, pred = head_token_losses(self.adapter.norm, self.adapter.lm_head, h, targets, step)
                    n = min(end + 1, seq_len) - (start + 1)
                    token_losses[:, start + 1 : start + 1 + n] = ce[:, :n]
                    predictions[:, start + 1 : start + 1 + n] = pred[:, :n]
                    total += ce.nan_to_num(0.0).sum()
                else:
                    total += head_loss(self.adapter.norm, self.adapter.lm_head, h, targets, step)[0]
                lead.chunk_done()
                passes.done()
        finally:
            self._probe = None
            self.store.free_all()
        return StepResult(loss=total / count, num_tokens=count, token_losses=token_losses, predictions=predictions)

    def _stage1(self, input_ids: torch.Tensor, bounds: list, rng_states: list, lead: HostLead,
                passes: "_Passes") -> None:
        """Stage 1 of chunks 0 .. n-2, appending each one's RNG state at its start.

        A sparse host layer's pages can only start moving once the layer's queries chose them,
        and its attention waits for them (~2.7 ms of PCIe for 256 candidate pages of a 7B layer,
        behind ~0.3 ms of projections). So with host layers, two chunks run interleaved, the
        newer one a layer behind (its layer i reads the older one's layer-i pages): one chunk's
        attention and MLP run while the other's pages load. Without dropout only: each chunk's
        stage 2 replays its stage-1 RNG, which interleaving would mix."""
        pages_per_chunk = self.config.pages_per_chunk
        width = 2 if self._interleave_stage1() else 1
        waiting, active = deque(range(len(bounds) - 1)), deque()
        while waiting or active:
            if waiting and len(active) < width:
                c = waiting.popleft()
                rng_states.append(self._rng_state())
                self.store.alloc_chunk(c, c * pages_per_chunk, pages_per_chunk)
                start, end = bounds[c]
                active.append(self._stage1_layers(c, input_ids[:, start:end], start))
            turn = active.popleft()  # the oldest chunk first: its layer i is stored before the next one's
            if next(turn, StopIteration) is StopIteration:
                lead.chunk_done()
                passes.done()
            else:
                active.append(turn)

    def _interleave_stage1(self) -> bool:
        return (self.sparse is not None and bool(self.store.host_layers)
                and not any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.model.modules()))

    def _stage1_chunk(self, c: int, ids: torch.Tensor, start: int, store: bool = True,
                      full: bool = False) -> torch.Tensor:
        """Run a chunk without autograd, storing its K/V; returns the final hidden states when
        `full`, else stops after the last layer's K/V (nothing else of it is needed). The
        attention outputs of the layers this step keeps (kept.layers) are kept for stage 2."""
        layers = self._stage1_layers(c, ids, start, store, full)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return done.value

    def _stage1_layers(self, c: int, ids: torch.Tensor, start: int, store: bool = True,
                       full: bool = False):
        """_stage1_chunk as a generator: it yields after each layer's projections and K/V write,
        before the layer's attention (whose pages may still be loading), and returns what
        _stage1_chunk returns."""
        a = self.adapter
        first_page = c * self.config.pages_per_chunk
        h = a.embed_tokens(ids)  # (B, C, hidden)
        ropes = self._layer_ropes(h, start)
        ahead = None  # the next layer's groups, when known before its projections (dense)
        for i, layer in enumerate(a.layers):
            attend = i < a.n_layers - 1 or full  # the last layer's output feeds nothing in stage 1
            q, k, v, groups = self._project(c, i, layer, h, *ropes[i], first_page, prefetch=attend, groups=ahead)
            if self._probe is not None and first_page > 0 and not self.shape.windows[i]:
                self._probe(c, i, q, k, self._selection.get((c, i)),
                            functools.partial(self.store.earlier_keys, i, first_page))
            if store:
                self.store.write(i, first_page, k, v)
            if not attend:
                break
            next_attends = i + 1 < a.n_layers - 1 or (full and i + 1 < a.n_layers)
            ahead = self._known_groups(c, i + 1, first_page) if next_attends else None
            if ahead is not None:
                groups.then(False, ahead)  # its first group loads while this layer computes
            yield
            if i in self.kept.layers:
                o, lse = attention_with_lse(q, k, v, groups, a.scale, self.backend, a.sinks(layer))
                self.kept.put(c, i, o, lse)
            else:
                o = paged_attention(q, k, v, groups, a.scale, self.backend, a.sinks(layer))
            h = a.finish_layer(layer, h, o)
        return h

    def _stage2_chunk(self, c: int, ids: torch.Tensor, start: int, targets: torch.Tensor,
                      denominator: int, last: bool, backward=contextlib.nullcontext) -> torch.Tensor:
        """Chunk c's recompute and backward (stage 2); `backward`: a context around its backward
        call through the layers (the step's last one: GradSums.finishing)."""
        a = self.adapter
        pages_per_chunk = self.config.pages_per_chunk
        first_page = c * pages_per_chunk

        ahead = LookAhead(c, functools.partial(self._known_groups, c, n_pages=first_page), a, self.kept,
                          self.config.checkpoint_layers)

        def layer_step(i, layer, h, cos, sin):
            known = self.kept.get(c, i)
            q, k, v, groups = self._project(c, i, layer, h, cos, sin, first_page, prefetch=known is None,
                                            groups=ahead.groups.get(i))
            ahead.forward(i, groups)
            if not last:
                # Later chunks' attention to this chunk's keys left its dK/dV in the pages.
                k, v = _AddPageGrads.apply(k, v, self.store.chunk_grads(i, first_page, pages_per_chunk))
            o = paged_attention(q, k, v, groups, a.scale, self.backend, a.sinks(layer), known=known)
            return a.finish_layer(layer, h, o), groups

        self.kept.prefetch(c)  # the first layers' kept attention outputs, when they are on the host
        with torch.enable_grad():
            h = a.embed_tokens(ids)
            ropes = self._layer_ropes(h, start)
            for i, layer in enumerate(a.layers):
                if self.config.checkpoint_layers:
                    # Keep only the layer's input; its forward runs again (same RNG, same pages)
                    # when its backward starts.
                    h = checkpoint(lambda x, i=i, layer=layer: layer_step(i, layer, x, *ropes[i])[0], h,
                                   use_reentrant=False)
                    continue
                h, groups = layer_step(i, layer, h, *ropes[i])
                h.register_hook(functools.partial(ahead.backward_starts, groups, i))  # its pages' transfers
            step = slice_tokens(a.vocab_size, ids.shape[0])
            ce_sum, grad_h = head_loss(a.norm, a.lm_head, h.detach(), targets, step, denominator, self._fused_ce)
            with backward():
                h.backward(grad_h)
        return ce_sum

    def _layer_ropes(self, h: torch.Tensor, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos, sin for the chunk h (B, C, hidden) at `start`: one adapter.rope() call
        per distinct RoPE of the layers (adapter.rope_key), shared by the layers that rotate by it;
        a single call for a model whose layers all rotate alike."""
        a = self.adapter
        by_key = {}
        for key in self._rope_keys:
            if key not in by_key:
                by_key[key] = a.rope(h, start, self._seq_len, self._docs, key=key)
        return [by_key[key] for key in self._rope_keys]

    def _known_groups(self, c: int, i: int, n_pages: int) -> ScheduledGroups | None:
        """The groups of earlier pages layer i of chunk c reads, when they are known before its
        projections (dense; sparse with a kept selection), else None."""
        window = self.shape.windows[i]
        # Sliding-window layers attend densely to the few pages they reach; dense_layers to all.
        if self.sparse is None or window or i in self._dense_layers:
            # Packed: pages of documents that ended before the chunk's first one are never read.
            first = self._first_pages[c] if self._docs is not None else 0
            return self.store.page_groups(i, n_pages, window=window, first_page=first, docs=self._docs)
        if (c, i) in self._selection:  # kept: its host copy is long done, the copy engines can move its pages
            return self.store.selected_groups(i, n_pages, self._selection[c, i], self.sparse.block_queries,
                                              copy_engines=True, docs=self._docs)
        return None

    def _project(self, c: int, i: int, layer, h, cos, sin, n_pages: int, prefetch: bool, groups=None):
        """q, k, v of layer i for chunk c, and the groups of earlier pages its attention reads
        (`groups`: made earlier, by _known_groups).

        The groups are made before the projections when the pages are known, so offloaded pages
        start moving while q/k/v are computed. Sparse pages depend on q: each (chunk, layer)
        selects once (the first pass that sees it: stage 1, or stage 2 for the last chunk) and
        keeps its selection for the other.
        """
        if groups is None:
            groups = self._known_groups(c, i, n_pages)
        if groups is not None and prefetch:
            groups.prefetch(False)
        q, k, v = self.adapter.project_qkv(layer, h, cos, sin)
        if groups is None:
            with torch.no_grad():  # indices only: nothing to differentiate, nothing to save
                selection = self.sparse.select(q, self.store.representatives(i, n_pages),
                                               *self._document_pages(c, n_pages))
                self._selection[c, i] = self.store.copy_to_host(i, selection)  # for stage 2's copies
            groups = self.store.selected_groups(i, n_pages, self._selection[c, i], self.sparse.block_queries,
                                                docs=self._docs)
            if prefetch:
                groups.prefetch(False)
        return q, k, v, groups

    def _document_pages(self, c: int, n_pages: int) -> tuple[int, torch.Tensor | None]:
        """Packed documents, for the sparse selection in chunk c: the first page its queries can see,
        and (B, n_blocks) the page of each query block's first document start; (0, None) unpacked."""
        if self._docs is None:
            return 0, None
        start = c * self.chunk_size
        firsts = self._docs.key_start[:, start : start + self.chunk_size : self.sparse.block_queries]
        return min(self._first_pages[c], n_pages), firsts.long() // self.page_size

    # -- placement: the step's sizes and measured memory, decided by placement.place() --------

    def _begin_step(self, batch: int, max_pages: int, training: bool = True) -> None:
        """Place a step's pages and kept attention outputs, refuse it when the memory cannot hold
        them, and size the store for it."""
        self._selection.clear()  # the last step's sparse selections (kept until now for inspection)
        cfg, memory = self.config, self.memory
        x = self.placement_input(batch, max_pages, training)
        decision = place(x)
        shape = self.shape
        self.store.place(list(shape.full_layers[decision.device_layers:]))
        kept = memory.kept_order(cfg, training, max_pages)[: decision.kept]
        self.kept.begin_step(kept, kept[decision.kept_gpu:], max_pages // shape.chunk_pages,
                             (batch, shape.query_heads, shape.chunk_size, shape.page.head_dim), shape.page.dtype)
        if x.kept_host_budget is not None and cfg.kept_host_bytes is None:
            memory.kept_host_budget = x.kept_host_budget  # the first step's, kept
        memory.check(cfg, batch, max_pages, decision.host_layers * x.layer_bytes)
        self.store.begin_step(batch, max_pages)

    def placement_input(self, batch: int, max_pages: int, training: bool = True) -> PlacementInput:
        """This engine's step of `batch` sequences and `max_pages` stored pages, as numbers for
        placement.place(): its sizes, and on a GPU the room measured at the first step."""
        return self.memory.placement_input(self.config, batch, max_pages, training)

    @property
    def keeps_attention(self) -> bool:
        """Whether this step keeps stage 1's attention outputs (of kept.layers; kept.host_layers'
        on the host)."""
        return bool(self.kept.layers)

    # -- helpers ------------------------------------------------------------------------------

    def _prepare(self, input_ids, labels, position_ids=None):
        """Checked (input_ids, labels) on the model's device, the predicted-token count and
        the chunks' (start, end) bounds; the step's packed documents (self._docs, or None) and the
        first page each chunk's queries can see (self._first_pages)."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; use input_ids.long()")
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}; "
                "for one sequence use input_ids[None]"
            )
        if input_ids.shape[1] < 2:
            raise ValueError(f"seq_len={input_ids.shape[1]} is too short: at least 2 tokens are needed to predict one")
        if labels is None:
            labels = input_ids
        if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError("labels must be an integer torch.Tensor (token ids, -100 where not predicted)")
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match input_ids shape {tuple(input_ids.shape)}; "
                "labels are per input position (shifted inside, as in transformers)"
            )
        input_ids, labels = input_ids.to(self.device, torch.long), labels.to(self.device, torch.long)
        seq_len = input_ids.shape[1]
        bounds = [(s, min(s + self.chunk_size, seq_len)) for s in range(0, seq_len, self.chunk_size)]
        self._docs, self._first_pages = None, []
        if position_ids is not None:
            positions = check_positions(position_ids, tuple(input_ids.shape)).to(self.device)
            # A document's first token is predicted by the last token of the one before: never a target.
            labels = labels.masked_fill(positions == 0, IGNORE_INDEX)
            self._docs = documents(positions)
            starts = self._docs.key_start[:, [start for start, _ in bounds]].amin(0)  # (n_chunks,)
            self._first_pages = (starts // self.page_size).tolist()  # one host copy a step
        count = int((labels[:, 1:] != IGNORE_INDEX).sum())
        if count == 0:
            raise ValueError("labels predict no token (all of labels[:, 1:] are -100); nothing to train on")
        self._seq_len = seq_len  # length-dependent RoPE sees the whole sequence's (adapter.rope)
        return input_ids, labels, count, bounds

    def _rng_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _rng_state(self):
        """RNG state at a chunk's start, so stage 2 redraws stage 1's dropout masks."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)


class _Passes:
    """Counts chunk passes for a progress(done, total) callback (or nothing without one)."""

    def __init__(self, progress, total: int) -> None:
        self.progress, self.total, self.count = progress, total, 0

    def done(self) -> None:
        self.count += 1
        if self.progress is not None:
            self.progress(self.count, self.total)


class _AddPageGrads(torch.autograd.Function):
    """Identity on k, v (B, Hkv, C, D); backward adds the chunk's gradient pages to dk, dv.

    `ready()` (PagedKVStore.chunk_grads) gives them at backward time, when every later chunk has
    finished adding into them. The sum rounds once: bf16 + bf16 computes in fp32.
    """

    @staticmethod
    def forward(ctx, k, v, ready):
        ctx.ready = ready
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        acc_k, acc_v = ctx.ready()  # (B, Hkv, C, D) grad dtype
        return torch.add(dk, acc_k).to(dk.dtype), torch.add(dv, acc_v).to(dv.dtype), None
