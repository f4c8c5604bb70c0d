"""Pictures with matplotlib's Agg backend (no display needed): training curves from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import DataError
from .io_utils import atomic_save


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works on servers without a display
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl; a missing or broken file is a DataError naming the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: no metrics yet; train first (tcli train --run-dir {run_dir})")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise DataError(f"{path}:{n}: not a JSON line") from None
    return records


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot_training(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw train/valid loss and valid BLEU/chrF against the update step; returns the PNG path."""
    records = read_metrics(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "training.png"
    plt = _pyplot()
    fig, (ax_loss, ax_score) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("train_loss", "train loss (smoothed CE)"), ("valid_loss", "valid loss (CE)")):
        steps, values = _series(records, key)
        if steps:
            ax_loss.plot(steps, values, marker="o" if key == "valid_loss" else None, markersize=3, label=label)
    ax_loss.set(xlabel="update step", ylabel="loss per target token", title="loss")
    ax_loss.legend(loc="upper right")
    for key, label in (("valid_bleu", "valid BLEU"), ("valid_chrf", "valid chrF")):
        steps, values = _series(records, key)
        if steps:
            ax_score.plot(steps, values, marker="o", markersize=3, label=label)
    ax_score.set(xlabel="update step", ylabel="score", title="validation")
    if ax_score.lines:
        ax_score.legend(loc="lower right")
    for ax in (ax_loss, ax_score):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_save(out, lambda tmp: fig.savefig(tmp, format=out.suffix.lstrip(".") or "png", dpi=120))
    plt.close(fig)
    return out


def plot_attention(weights: list, src_labels: list[str], tgt_labels: list[str], out: str | Path,
                   layers: list[int] | None = None, per_head: bool = False, title: str = "cross-attention") -> Path:
    """Heatmaps of attention weights: one row of panels per layer, one panel per head or their average.

    weights: per layer a (H, T, S) tensor (query rows labelled tgt_labels, key columns src_labels).
    layers: 0-based layer indices to draw (default all). Returns the PNG path.
    """
    out = Path(out)
    layers = list(range(len(weights))) if layers is None else layers
    panels = [[weights[i][h] for h in range(weights[i].shape[0])] if per_head else [weights[i].mean(0)]
              for i in layers]  # rows of (T, S) matrices
    names = [[f"layer {i + 1}, head {h + 1}" for h in range(len(row))] if per_head else [f"layer {i + 1}, heads averaged"]
             for i, row in zip(layers, panels)]
    rows, cols = len(panels), max(len(r) for r in panels)
    cell_w = max(3.0, 0.28 * len(src_labels) + 1.2)
    cell_h = max(2.5, 0.25 * len(tgt_labels) + 1.0)
    plt = _pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(cell_w * cols, cell_h * rows), squeeze=False)
    for r, (row, row_names) in enumerate(zip(panels, names)):
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(row):
                ax.axis("off")
                continue
            ax.imshow(row[c].float().numpy(), cmap="viridis", vmin=0.0, aspect="auto")
            ax.set_xticks(range(len(src_labels)), src_labels, rotation=90, fontsize=7)
            ax.set_yticks(range(len(tgt_labels)), tgt_labels, fontsize=7)
            ax.set_title(row_names[c], fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    atomic_save(out, lambda tmp: fig.savefig(tmp, format=out.suffix.lstrip(".") or "png", dpi=110))
    plt.close(fig)
    return out
