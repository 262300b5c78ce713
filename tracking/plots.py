"""PNG pictures for MLflow artifacts: mask heatmaps, density histograms, loss curves, study plots.

Mask heatmaps are drawn with PIL (`HeatmapWriter`: there are many per update step); the other
figures use matplotlib's object API on the Agg canvas (no pyplot state, no display), so both
are safe in Ray workers and threads. Every matplotlib figure is written through `save_figure`,
which refuses a figure with an empty panel: an axes without data reads as "this metric is
missing".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # worker processes have no display

import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# Heatmaps are block-averaged down to at most this many cells per side: a 4096 x 4096
# mask would otherwise be a 16-megapixel image per update step, and single weights are not
# visible on screen anyway.
MAX_HEATMAP_SIDE = 256
Curves = Mapping[str, Sequence[tuple[int, float]]]


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


def axes_hold_data(axes: Axes) -> bool:
    """Whether a panel shows anything: a line with points, bars, an image or scattered points."""
    lines = any(len(line.get_xdata()) for line in axes.lines)
    collections = any(len(c.get_offsets()) for c in axes.collections)
    return lines or collections or bool(axes.patches) or bool(axes.images)


def save_figure(figure: Figure, path: Path) -> None:
    """Write `figure` as PNG; ValueError naming the panel when one of them holds no data."""
    for axes in figure.axes:
        if not axes_hold_data(axes):
            raise ValueError(f"{Path(path).name}: panel {axes.get_title() or axes.get_ylabel()!r} "
                             "holds no data")
    figure.savefig(path)


class HeatmapWriter:
    """Mask heatmaps, one PNG per layer, drawn with PIL: rows are output units, columns inputs,
    the colour the kept fraction of each block (one weight per cell for small layers), titled
    with the layer, step and density, with axis labels, ticks and a colour bar. A model has
    dozens of masked layers per update step: a matplotlib figure per layer took 40-400 ms
    (idle to busy machine), this about a tenth of that. The title also goes into the PNG's
    text chunks."""

    SIZE = (640, 560)
    PLOT = (80, 64, 520, 484)  # left, top, right, bottom of the heatmap in the image
    BAR = (548, 64, 566, 484)  # the colour bar
    TICKS = 5

    def __init__(self) -> None:
        from PIL import ImageFont

        self.font = ImageFont.load_default(size=13)
        self.colours = matplotlib.colormaps["viridis"]

    def render(self, mask: np.ndarray, *, name: str, step: int) -> tuple[Any, dict[str, str]]:
        """(PIL image, PNG text chunks) for `mask` (2-D, bool or 0/1)."""
        from PIL import Image, ImageDraw

        rows, cols = mask.shape
        cells = block_density(mask.astype(np.float64))
        block_rows, block_cols = -(-rows // cells.shape[0]), -(-cols // cells.shape[1])
        blocks = "" if block_rows == block_cols == 1 else f", blocks of {block_rows}x{block_cols}"
        title = f"step {step}, density {float(mask.mean()):.1%} ({rows}x{cols}{blocks})"
        image = Image.new("RGB", self.SIZE, "white")
        left, top, right, bottom = self.PLOT
        heat = Image.fromarray(self.colours(cells, bytes=True)[..., :3])
        image.paste(heat.resize((right - left, bottom - top), Image.Resampling.NEAREST),
                    (left, top))
        draw = ImageDraw.Draw(image)
        draw.rectangle(self.PLOT, outline="black")
        draw.text((self.SIZE[0] // 2, 8), name, fill="black", font=self.font, anchor="mt")
        draw.text((self.SIZE[0] // 2, 28), title, fill="black", font=self.font, anchor="mt")
        for i in range(self.TICKS + 1):  # ticks count weights, not blocks
            x = left + (right - left) * i // self.TICKS
            y = top + (bottom - top) * i // self.TICKS
            draw.line((x, bottom, x, bottom + 4), fill="black")
            draw.text((x, bottom + 6), str(cols * i // self.TICKS), fill="black",
                      font=self.font, anchor="mt")
            draw.line((left - 4, y, left, y), fill="black")
            draw.text((left - 6, y), str(rows * i // self.TICKS), fill="black", font=self.font,
                      anchor="rm")
        draw.text(((left + right) // 2, bottom + 26), "input (column)", fill="black",
                  font=self.font, anchor="mt")
        self._vertical_text(image, "output unit (row)", (12, (top + bottom) // 2))
        bar_left, bar_top, bar_right, bar_bottom = self.BAR
        ramp = self.colours(np.linspace(1.0, 0.0, bar_bottom - bar_top)[:, None], bytes=True)
        image.paste(Image.fromarray(ramp[..., :3]).resize((bar_right - bar_left,
                                                          bar_bottom - bar_top)),
                    (bar_left, bar_top))
        draw.rectangle(self.BAR, outline="black")
        draw.text((bar_right + 4, bar_top), "1", fill="black", font=self.font, anchor="lm")
        draw.text((bar_right + 4, bar_bottom), "0", fill="black", font=self.font, anchor="lm")
        self._vertical_text(image, "kept fraction" if blocks else "kept (1) / pruned (0)",
                            (self.SIZE[0] - 30, (bar_top + bar_bottom) // 2))
        return image, {"Title": name, "Description": title}

    def write(self, mask: np.ndarray, path: Path, *, name: str, step: int) -> None:
        from PIL.PngImagePlugin import PngInfo

        image, text = self.render(mask, name=name, step=step)
        info = PngInfo()
        for key, value in text.items():
            info.add_text(key, value)
        image.save(path, pnginfo=info)

    def _vertical_text(self, image: Any, text: str, centre: tuple[int, int]) -> None:
        from PIL import Image, ImageDraw

        box = self.font.getbbox(text)
        label = Image.new("RGB", (box[2] + 4, box[3] + 4), "white")
        ImageDraw.Draw(label).text((2, 2), text, fill="black", font=self.font)
        label = label.rotate(90, expand=True)
        image.paste(label, (centre[0] - label.width // 2, centre[1] - label.height // 2))


def write_density_histogram_png(densities: Mapping[str, float], path: Path, title: str) -> None:
    """Histogram of per-layer mask densities."""
    figure = Figure(figsize=(5, 3.5), dpi=100)
    axes = figure.add_subplot()
    axes.hist(list(densities.values()), bins=min(20, max(5, len(densities))), range=(0.0, 1.0))
    axes.set_xlabel("density (kept fraction)")
    axes.set_ylabel("layers")
    axes.set_title(title)
    figure.tight_layout()
    save_figure(figure, path)


def curves_figure(curves: Curves, title: str | None = None,
                  colours: Mapping[str, str] | None = None) -> Figure:
    """A loss panel and a perplexity panel (log scale), each only when some curve is for it;
    `colours` by curve name (else matplotlib's cycle)."""
    panels = {"loss": {k: v for k, v in curves.items() if not k.endswith("perplexity")},
              "perplexity": {k: v for k, v in curves.items() if k.endswith("perplexity")}}
    panels = {label: group for label, group in panels.items() if group}
    if not panels:
        raise ValueError("curves must hold at least one curve")
    figure = Figure(figsize=(5 * len(panels), 4), dpi=100)
    for axes, (label, group) in zip(figure.subplots(1, len(panels), squeeze=False)[0],
                                    panels.items()):
        for name, points in sorted(group.items()):
            axes.plot([s for s, _ in points], [v for _, v in points], label=name,
                      marker="." if len(points) < 50 else None,
                      color=(colours or {}).get(name))
        axes.set_xlabel("step")
        axes.set_ylabel(label)
        axes.set_title(label)
        if label == "perplexity":
            axes.set_yscale("log")
        plain_tick_labels(axes)
        axes.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def write_curves_png(curves: Curves, path: Path, title: str | None = None) -> None:
    save_figure(curves_figure(curves, title), path)


def tradeoff_figure(points: Sequence[tuple[str, float, float, str]], title: str) -> Figure:
    """Final eval perplexity against projected CS-2 speed-up, one labelled dot per
    (name, speed-up, perplexity, colour)."""
    figure = Figure(figsize=(6, 4.5), dpi=100)
    axes = figure.add_subplot()
    for name, speedup, perplexity, colour in points:
        axes.scatter([speedup], [perplexity], color=colour, s=40)
        axes.annotate(name, (speedup, perplexity), textcoords="offset points", xytext=(5, 4),
                      fontsize=8)
    axes.set_xlabel("projected CS-2 speed-up vs dense (x)")
    axes.set_ylabel("final eval perplexity")
    axes.set_title(f"{title}: quality vs projected speed")
    axes.set_xlim(*readable_span([speedup for _, speedup, _, _ in points], MIN_SPEEDUP_SPAN))
    axes.grid(alpha=0.3)
    plain_tick_labels(axes)
    figure.tight_layout()
    return figure


# Speed-ups are reported to two decimals: differences below that must not fill the axis.
MIN_SPEEDUP_SPAN = 0.1


def readable_span(values: Sequence[float], min_span: float) -> tuple[float, float]:
    """Axis limits around `values` with a 5% margin, at least `min_span` wide (centred), so
    differences far below what the numbers mean are not stretched over the whole axis."""
    low, high = min(values), max(values)
    margin = 0.05 * (high - low)
    low, high = low - margin, high + margin
    if high - low < min_span:
        centre = (low + high) / 2
        low, high = centre - min_span / 2, centre + min_span / 2
    return low, high


def plain_tick_labels(axes: Axes) -> None:
    """Tick labels as the values themselves: no "1e-5+1" offset or scientific factor."""
    for axis in (axes.xaxis, axes.yaxis):
        if axis.get_scale() == "linear":
            axis.get_major_formatter().set_useOffset(False)
            axis.get_major_formatter().set_scientific(False)
