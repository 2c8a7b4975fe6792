"""What the engine, the page store, offload, the memory plan and evaluation need of a sparse
attention policy: the one interface a new policy implements (TopKPages, attention/sparse.py, is one).

A policy decides, for each chunk and full-attention layer, which earlier pages each block of
`block_queries` queries attends (the chunk itself is always attended, causally); the engine makes
that choice once, in the first pass that reaches the (chunk, layer), and keeps it for the other,
so forward and backward see the same pattern and the gradients are exact for it. Everything else
(paging, offload, kernels, the plan's bytes) follows from the members below; none of the code
that reads them knows which policy it is.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from ..memory.spec import Selection


@runtime_checkable
class SparsePolicy(Protocol):
    """A page-level sparse attention policy, as EngineConfig(sparse=...) takes it.

    Sizes: a chunk with n earlier pages (from its first visible page on) reads
    min(chunk_budget, n) of them (Selection.pages) and each query block min(budget, n) of those
    (Selection.blocks); the memory plan counts exactly these.
    """

    @property
    def block_queries(self) -> int:
        """Queries that share one selection (a query block; a multiple of the Triton kernel's
        query tile)."""

    @property
    def budget(self) -> int:
        """Pages each query block attends per KV head (sinks included)."""

    @property
    def chunk_budget(self) -> int:
        """Pages one chunk reads of a layer, >= budget: a host layer's staging buffer holds this
        many pages per sequence (memory/offload.py), and the plan stages them."""

    @property
    def rep_size(self) -> int:
        """Vectors per page and KV head that summarise a page (0: the policy reads none; no
        representative memory is allocated). The plan counts rep_size x head_dim x dtype bytes
        per page and KV head of every full layer."""

    def representatives(self, k: torch.Tensor, n_pages: int) -> torch.Tensor:
        """The summary of whole pages, stored with them (memory/store.py), that select() reads:
        k (B, Hkv, n_pages * P, D) post-RoPE keys -> (B, n_pages, Hkv, rep_size, D) in k's dtype.
        Called only when rep_size > 0."""

    def select(self, q: torch.Tensor, reps: torch.Tensor, first_page: int = 0,
               block_pages: torch.Tensor | None = None) -> Selection:
        """The pages a chunk's query blocks attend.

        q: (B, H, C, D) the chunk's post-RoPE queries; reps: (B, n, Hkv, rep_size, D) of the n
        earlier pages (rep_size 0: an empty tensor that still gives n). Packed documents:
        first_page, the first page any query of the chunk sees (pages before it must not be
        read), and block_pages (B, n_blocks) int64, the page of each query block's first document
        start (picks before it are masked by attention); (0, None) for one document a sequence.
        Returns logical pages: Selection.pages (B, n_cand) int32 ascending, Selection.blocks
        (B, Hkv, n_blocks, k) ascending indices into them, of dtype
        memory.spec.index_dtype(n_cand).
        """

    def dense_set(self, n_layers: int) -> frozenset[int]:
        """The layers (0 .. n_layers - 1) that attend every earlier page instead of selecting
        (a ValueError naming the layer when one does not exist)."""

    def describe(self) -> dict:
        """The policy's settings, JSON-ready, for evaluation reports (oomb eval)."""



def check_policy(sparse: object) -> None:
    """Refuse (ValueError) a policy that lacks SparsePolicy's members or whose sizes the engine and
    the plan cannot use, before a model is touched (EngineConfig)."""
    missing = [name for name in vars(SparsePolicy) if not name.startswith("_") and not hasattr(sparse, name)]
    if missing:
        raise ValueError(f"sparse={sparse!r} must be None (dense) or oomb.TopKPages(budget=...), or another "
                         f"oomb.SparsePolicy (attention/policy.py); it lacks {', '.join(missing)}")
    for name, least in (("block_queries", 1), ("budget", 1), ("chunk_budget", 1), ("rep_size", 0)):
        value = getattr(sparse, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"sparse={sparse!r}: {name}={value!r} must be an int >= {least}")
    if sparse.chunk_budget < sparse.budget:
        raise ValueError(f"sparse={sparse!r}: chunk_budget={sparse.chunk_budget} must be >= budget={sparse.budget} "
                         "(the pages a chunk's query blocks choose from)")


#: the policies `--sparse-policy NAME` names: NAME -> a function of the run's sparse_* settings (a
#: TrainConfig, or `oomb plan` / `oomb eval`'s flags) that builds the policy. TopKPages registers
#: 'topk' (attention/sparse.py); a new policy registers itself in its own file.
POLICIES: dict[str, Callable[[object], SparsePolicy]] = {}


def register_policy(name: str, build: Callable[[object], SparsePolicy]) -> None:
    """Make `--sparse-policy name` build its policy with build(settings)."""
    POLICIES[name] = build


def build_policy(settings) -> SparsePolicy | None:
    """The policy a run's sparse_* settings ask for: None (dense) when sparse_budget is 0, else the
    registered sparse_policy's (a ValueError naming the registered ones for an unknown name)."""
    if not settings.sparse_budget:
        return None
    check_policy_name(settings.sparse_policy)
    return POLICIES[settings.sparse_policy](settings)


def check_policy_name(name: str) -> None:
    """Refuse (ValueError) a --sparse-policy that no policy registered."""
    if name not in POLICIES:
        raise ValueError(f"sparse_policy={name!r} is not a registered sparse policy; registered: "
                         f"{', '.join(sorted(POLICIES))} (a new one: oomb.register_policy(name, build))")
