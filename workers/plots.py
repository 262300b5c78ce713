"""PNG pictures for MLflow artifacts: mask heatmaps, density histograms, loss curves.

Uses matplotlib's object API on the Agg canvas (no pyplot state, no display), so it is safe
in Ray workers and threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # worker processes have no display

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import imsave  # noqa: E402

# Heatmaps are block-averaged down to at most this many pixels per side: a 4096 x 4096
# mask would otherwise be a 16-megapixel image per update step.
MAX_HEATMAP_SIDE = 256


def block_density(mask: np.ndarray, max_side: int = MAX_HEATMAP_SIDE) -> np.ndarray:
    """Fraction of kept weights in each block of a 2-D mask, at most max_side per axis."""
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D, got shape {mask.shape}")
    rows, cols = mask.shape
    row_block = -(-rows // max_side)
    col_block = -(-cols // max_side)
    padded = np.zeros((-(-rows // row_block) * row_block, -(-cols // col_block) * col_block))
    counts = np.zeros_like(padded)
    padded[:rows, :cols] = mask
    counts[:rows, :cols] = 1.0
    shape = (padded.shape[0] // row_block, row_block, padded.shape[1] // col_block, col_block)
    kept = padded.reshape(shape).sum(axis=(1, 3))
    cells = counts.reshape(shape).sum(axis=(1, 3))
    return kept / cells


def write_mask_heatmap_png(mask: np.ndarray, path: Path) -> None:
    """Kept weights bright, pruned dark; big layers show the density of each block."""
    imsave(path, block_density(mask.astype(np.float64)), cmap="viridis", vmin=0.0, vmax=1.0)


def write_density_histogram_png(densities: Mapping[str, float], path: Path, title: str) -> None:
    """Histogram of per-layer mask densities."""
    figure = Figure(figsize=(5, 3.5), dpi=100)
    axes = figure.add_subplot()
    axes.hist(list(densities.values()), bins=min(20, max(5, len(densities))), range=(0.0, 1.0))
    axes.set_xlabel("density (kept fraction)")
    axes.set_ylabel("layers")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)


def write_curves_png(curves: Mapping[str, Sequence[tuple[int, float]]], path: Path) -> None:
    """Loss curves on the left, perplexity curves (log scale) on the right."""
    figure = Figure(figsize=(10, 4), dpi=100)
    loss_axes, ppl_axes = figure.subplots(1, 2)
    for name, points in sorted(curves.items()):
        steps = [step for step, _ in points]
        values = [value for _, value in points]
        axes = ppl_axes if name.endswith("perplexity") else loss_axes
        axes.plot(steps, values, label=name, marker="." if len(points) < 50 else None)
    for axes, label in ((loss_axes, "loss"), (ppl_axes, "perplexity")):
        axes.set_xlabel("step")
        axes.set_ylabel(label)
        if axes.lines:
            axes.legend()
    if ppl_axes.lines:
        ppl_axes.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path)
