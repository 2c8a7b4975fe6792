"""Long-context evaluation on top of the engine: each task is one file here that declares an
EvalTask (registry.py: its name, flags, run, report and plot) and one `register` line below;
`oomb eval --task NAME` runs it. Each runs through the engine's evaluation path (one stage-1 pass
per sequence: pages, offload and top-k sparse attention as in training, so they run at 1M tokens).

    loss              mean cross entropy per predicted token (loss.py)
    position-loss     mean cross entropy by the target's position (position_loss.py)
    retrieval         key-value needles by context length and depth (retrieval.py)
    kv-recall         single-token key-value recall by needle-to-query distance (kv_recall.py)
    selection-recall  top-k's share of the exact attention mass, per layer (selection_recall.py)

inputs.py holds the sequences several tasks evaluate, plots.py the PNGs.
"""
from . import kv_recall, loss, position_loss, retrieval, selection_recall
from .registry import TASKS, EvalTask, register

DEFAULT_TASK = "loss"  # oomb eval's --task when none is given

register(loss.TASK)
register(position_loss.TASK)
register(retrieval.TASK)
register(kv_recall.TASK)
register(selection_recall.TASK)

__all__ = ["DEFAULT_TASK", "TASKS", "EvalTask", "register"]
