"""oomb: train causal LMs on million-token contexts on one GPU.

    engine = oomb.ChunkRecurrentEngine(model, chunk_size=4096, page_size=128)
    # or: oomb.ChunkRecurrentEngine(model, oomb.EngineConfig(chunk_size=4096, offload="auto"))
    result = engine.forward_backward(input_ids, labels)   # grads accumulated in .grad
"""
from .attention.policy import SparsePolicy
from .attention.sparse import TopKPages
from .config import EngineConfig, KernelOptions
from .engine import ChunkRecurrentEngine, StepResult
from .memory.spec import PageSpec, Selection

__all__ = ["ChunkRecurrentEngine", "EngineConfig", "KernelOptions", "PageSpec", "Selection", "SparsePolicy",
           "StepResult", "TopKPages"]
__version__ = "0.1.0"
