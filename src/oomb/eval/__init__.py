"""Long-context evaluation on top of the engine: tasks.py (loss, position-loss, retrieval,
selection-recall), plots.py (their PNGs). `oomb eval --task ...` runs them."""
from .tasks import mean_loss, position_loss, retrieval, selection_recall

__all__ = ["mean_loss", "position_loss", "retrieval", "selection_recall"]
