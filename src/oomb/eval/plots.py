"""PNG plots of evaluation results (matplotlib, no display needed)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _mid(bucket: dict) -> float:
    return max(1.0, (bucket["start"] * bucket["end"]) ** 0.5 if bucket["start"] else bucket["end"] / 2)


def position_loss(results: dict[str, dict], path: str, title: str = "") -> None:
    """Loss vs position (log x), one line per labelled position-loss result."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, r in results.items():
        xs = [_mid(b) for b in r["buckets"]]
        ax.plot(xs, [b["loss"] for b in r["buckets"]], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the sequence (tokens, bucket centre)")
    ax.set_ylabel("mean cross entropy (nats)")
    ax.set_title(title or "loss by position")
    ax.grid(True, alpha=0.3)
    if len(results) > 1 or next(iter(results)):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def retrieval(result: dict, path: str, title: str = "") -> None:
    """Accuracy heatmap: lengths (rows) x depths (columns)."""
    grid = result["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(result["depths"]) + 2, 0.6 * len(result["lengths"]) + 1.8))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(result["depths"])), [f"{d:g}" for d in result["depths"]])
    ax.set_yticks(range(len(result["lengths"])), [f"{n // 1024}K" if n >= 1024 else str(n) for n in result["lengths"]])
    ax.set_xlabel("needle depth (0: start of the context, 1: its end)")
    ax.set_ylabel("context length")
    for r, row in enumerate(grid):
        for c, v in enumerate(row):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(title or f"key-value retrieval ({result['samples']} samples a cell)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def selection_recall(results: dict[str, dict], path: str, title: str = "") -> None:
    """Recall per layer, one line per labelled selection-recall result."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, r in results.items():
        ax.plot([x["layer"] for x in r["layers"]], [x["recall"] for x in r["layers"]], marker="o", ms=3,
                label=label or f"budget {r['budget']}")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention mass on what top-k attends")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "top-k selection recall")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
