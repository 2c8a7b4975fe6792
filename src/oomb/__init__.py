"""oomb: train causal LMs on million-token contexts on one GPU.

    engine = oomb.ChunkRecurrentEngine(model, chunk_size=4096, page_size=128)
    # or: oomb.ChunkRecurrentEngine(model, oomb.EngineConfig(chunk_size=4096, offload="auto"))
    result = engine.forward_backward(input_ids, labels)   # grads accumulated in .grad

    oomb.train(oomb.TrainConfig(model="/path/to/ckpt", seq_len=65536), callbacks=[...])  # oomb train's loop
"""
from .attention.policy import SparsePolicy, register_policy
from .attention.sparse import TopKPages
from .config import EngineConfig, KernelOptions
from .engine import ChunkRecurrentEngine, StepResult
from .memory.spec import PageSpec, Selection
from .train.callbacks import Callback  # binds oomb.train too: the trainer's package, callable (train/__init__.py)

__all__ = ["Callback", "ChunkRecurrentEngine", "EngineConfig", "KernelOptions", "PageSpec", "Selection", "SparsePolicy",
           "StepResult", "TopKPages", "TrainConfig", "register_policy", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """oomb.TrainConfig, imported when first asked for (it brings in transformers: a second)."""
    if name == "TrainConfig":
        from .train.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'oomb' has no attribute {name!r}")
