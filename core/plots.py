"""Pictures people would rather see than read: image grids, reliability diagrams, scatters.

Image grids are drawn with PIL (exact pixels, deterministic bytes); charts are matplotlib
figures of their own (`matplotlib.figure.Figure`, no pyplot), imported lazily so that importing
this module costs nothing, and rendered by the Agg canvas that `savefig` picks for a PNG. Every
file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from core.io import atomic_write_bytes


def image_grid(
    images: np.ndarray,
    path: Path,
    *,
    row_labels: Sequence[str] = (),
    col_labels: Sequence[str] = (),
    scale: int = 1,
    pad: int = 2,
) -> Path:
    """uint8 [rows, cols, H, W, 3] -> one PNG; optional text labels left of rows / above columns.

    Used for generate's preview (rows = series, columns = α) and fit-generator's sample grid.
    """
    images = np.asarray(images)
    if images.ndim != 5 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(
            f"image_grid expects uint8 [rows, cols, H, W, 3], got {images.dtype} {images.shape}"
        )
    rows, cols, h, w, _ = images.shape
    h, w = h * scale, w * scale
    left = 8 + 7 * max((len(s) for s in row_labels), default=0) if row_labels else 0
    top = 14 if col_labels else 0
    canvas = Image.new(
        "RGB", (left + cols * (w + pad) + pad, top + rows * (h + pad) + pad), "white"
    )
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        y = top + pad + r * (h + pad)
        if r < len(row_labels):
            draw.text((2, y + h // 2 - 5), row_labels[r], fill="black")
        for c in range(cols):
            tile = Image.fromarray(images[r, c])
            if scale != 1:
                tile = tile.resize((w, h), Image.Resampling.NEAREST)
            canvas.paste(tile, (left + pad + c * (w + pad), y))
    for c, label in enumerate(col_labels):
        draw.text((left + pad + c * (w + pad), 1), label, fill="black")
    buf = io.BytesIO()
    canvas.save(buf, format="PNG", compress_level=6)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def _figure(**kwargs):
    """A `matplotlib.figure.Figure(**kwargs)` of its own: no pyplot, so no backend to switch, no
    global list of figures to register it in and close it from (it is freed with its last
    reference), and nothing shared between two charts drawn in one process."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig, path: Path) -> Path:
    """`fig` as a PNG at 120 dpi. A figure with a layout engine (constrained) already fits its
    page and is saved as laid out; one without keeps fixed margins, which a long title or a
    wide legend outgrows, so it is saved cropped to what it draws (bbox "tight", one more pass
    over the artists to measure them)."""
    buf = io.BytesIO()
    bbox = None if fig.get_layout_engine() is not None else "tight"
    # no timestamps in the file: same figure, same bytes
    fig.savefig(buf, format="png", dpi=120, bbox_inches=bbox, metadata={"Software": None})
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


# reliability diagram colours: opaque, so that what a legend patch shows is what a bin shows
ACCURACY, OVER, UNDER = "tab:blue", "#eb9a9a", "#f2c46d"


def reliability_diagram(
    panels: Mapping[str, Mapping[str, Sequence[float]]], path: Path, title: str = ""
) -> Path:
    """One column per panel (e.g. "before TS", "after TS"): a reliability diagram over the
    number of images per confidence bin. A panel holds per-bin `acc`, `conf`, `count`
    (equal-width bins in (0, 1]) and optionally `ece` (in %, shown in the panel's title).

    Each non-empty bin is a bar up to its accuracy; the gap to its mean confidence is red above
    the bar (over-confident: confidence > accuracy) or amber in its top part (under-confident).
    Every panel carries the whole legend, whether or not its bins show each kind, and every
    histogram bar is labelled with its count."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = _figure(figsize=(4 * len(panels), 5.5), layout="constrained")
    axes = fig.subplots(
        2, len(panels), sharex=True, squeeze=False, gridspec_kw={"height_ratios": [3, 1]}
    )
    legend = [
        Patch(facecolor=ACCURACY, edgecolor="black", label="accuracy"),
        Patch(facecolor=OVER, edgecolor=OVER, label="gap: confidence > accuracy"),
        Patch(facecolor=UNDER, edgecolor=UNDER, label="gap: accuracy > confidence"),
        Line2D([0], [0], color="black", ls="--", lw=1, label="perfect calibration"),
    ]
    for col, (name, p) in enumerate(panels.items()):
        acc, conf, count = (np.asarray(p[k], dtype=float) for k in ("acc", "conf", "count"))
        n_bins = len(count)
        centers = (np.arange(n_bins) + 0.5) / n_bins
        width = 1.0 / n_bins
        ax, hist = axes[0, col], axes[1, col]
        shown = count > 0
        over, under = shown & (conf > acc), shown & (conf < acc)
        ax.bar(centers[shown], acc[shown], width=width, color=ACCURACY, edgecolor="black")
        ax.bar(centers[over], (conf - acc)[over], bottom=acc[over], width=width, color=OVER,
               edgecolor=OVER)  # fmt: skip
        ax.bar(centers[under], (acc - conf)[under], bottom=conf[under], width=width, color=UNDER,
               edgecolor=UNDER)  # fmt: skip
        # the accuracy bars' outlines again, on top of the amber gaps drawn inside them
        ax.bar(centers[shown], acc[shown], width=width, fill=False, edgecolor="black")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ece = f"  (ECE {p['ece']:.2f} %)" if "ece" in p else ""
        ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy", title=name + ece)
        ax.legend(handles=legend, loc="upper left", fontsize=7)
        bars = hist.bar(centers, count, width=width, color="gray", edgecolor="black")
        hist.bar_label(bars, labels=[_count_label(c) for c in count], fontsize=6, padding=1)
        hist.set(xlabel="confidence", ylabel="images", ylim=(0, 1.3 * max(count.max(), 1)))
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _count_label(count: float) -> str:
    """A histogram bar's label, narrow enough for 15 bins: 0 -> "", 950, 9.5k, 12k, 1.2M."""
    if count <= 0:
        return ""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return f"{count:.0f}"


def scatter(
    x: Sequence[float],
    y: Sequence[float],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    diagonal: bool = False,
    jitter: float = 0.0,
    seed: int = 0,
) -> Path:
    """A scatter plot (e.g. annotate's λ̂ vs α), with an optional y = x reference line."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if jitter:
        x = x + np.random.default_rng(seed).uniform(-jitter, jitter, size=x.shape)
    fig = _figure(figsize=(5, 4))
    ax = fig.subplots()
    ax.scatter(x, y, s=6, alpha=0.4)
    if diagonal:
        lo, hi = min(x.min(), y.min()), max(x.max(), y.max())
        ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(fig, path)


def ternary(
    weights: Sequence[Sequence[float]],
    lambda_hat: Sequence[Sequence[float]],
    path: Path,
    *,
    corners: Sequence[str] = ("class 1", "class 2", "class 3"),
    title: str = "",
) -> Path:
    """k = 3 annotation picture: λ̂ [N, 3] as points of the simplex triangle (coloured by the
    lattice point w [N, 3] that generated them; black crosses = the lattice). Barycentric
    (b_1, b_2, b_3) sits at (b_2 + b_3/2, b_3·√3/2); points outside the triangle have λ̂ < 0."""
    w, lam = np.asarray(weights, dtype=float), np.asarray(lambda_hat, dtype=float)

    def xy(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return b[:, 1] + b[:, 2] / 2, b[:, 2] * np.sqrt(3) / 2

    _, colour = np.unique(w, axis=0, return_inverse=True)
    fig = _figure(figsize=(5, 4.6))
    ax = fig.subplots()
    ax.plot([0, 1, 0.5, 0], [0, 0, np.sqrt(3) / 2, 0], "k-", lw=1)
    ax.scatter(*xy(lam), c=colour.reshape(-1), cmap="viridis", s=6, alpha=0.4)
    ax.scatter(*xy(np.unique(w, axis=0)), marker="x", c="black", s=30, lw=1)
    for (x, y), name in zip(((0, 0), (1, 0), (0.5, np.sqrt(3) / 2)), corners):
        ax.annotate(name, (x, y), ha="center", va="top" if y == 0 else "bottom",
                    xytext=(0, -4 if y == 0 else 4), textcoords="offset points")  # fmt: skip
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(title)
    return _save(fig, path)


def error_bars(
    groups: Mapping[str, Mapping[str, tuple[float, float]]],
    path: Path,
    *,
    ylabel: str,
    title: str = "",
) -> Path:
    """Grouped bars with error bars: {series: {category: (mean, std)}}, e.g. ECE per method
    before and after temperature scaling, mean ± std over seeds."""
    categories = list(dict.fromkeys(c for g in groups.values() for c in g))
    fig = _figure(figsize=(max(5, 0.8 * len(categories) + 2), 3.8))
    ax = fig.subplots()
    width = 0.8 / max(len(groups), 1)
    for k, (name, values) in enumerate(groups.items()):
        xs = [i + (k - (len(groups) - 1) / 2) * width for i in range(len(categories))]
        means = [values.get(c, (np.nan, 0.0))[0] for c in categories]
        stds = [values.get(c, (np.nan, 0.0))[1] for c in categories]
        ax.bar(xs, means, width=width, yerr=stds, capsize=3, label=name, edgecolor="black")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.legend()
    return _save(fig, path)


def lines(
    series: Mapping[str, Sequence[float]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str = "",
    title: str = "",
) -> Path:
    """Several curves over a shared x = 1..n: per-epoch values (e.g. MaC-Cal's q, accuracy and
    confidence), epochs counted from 1 as in the logs and metrics.json."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(figsize=(5, 3.5))
    ax = fig.subplots()
    for name, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", ms=3, label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    return _save(fig, path)


def panels(
    data: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    path: Path,
    *,
    xlabel: str,
    title: str = "",
) -> Path:
    """Side-by-side panels of curves: {panel's y label: {curve: (xs, ys)}}, e.g. ECE and NLL
    against corruption severity, one curve per method."""
    fig = _figure(figsize=(5 * len(data), 4))
    axes = fig.subplots(1, len(data), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], data.items()):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", ms=3, label=name)
        ax.set(xlabel=xlabel, ylabel=ylabel)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def draw_guidance_cells(
    ax,
    cells: Sequence[tuple[str | None, float, float]],
    *,
    floor: float | None = None,
    kept: Sequence[tuple[str | None, float]] = (),
    chosen: tuple[str | None, float] | None = None,
    chosen_label: str = "chosen",
) -> None:
    """Endpoint fidelity against the guidance weight w on `ax`: `cells` (clipping, w,
    fidelity %), one line per clipping setting ("on", "off"; None: the sampler's saved one),
    the fidelity `floor` a dashed line, the `kept` cells ringed, the `chosen` cell a star
    (legend `chosen_label`). Separate from its file so that a test reads the drawn data."""
    for clip in dict.fromkeys(c for c, _, _ in cells):
        points = sorted((w, f) for c, w, f in cells if c == clip)
        name = "x̂₀ clipping " + clip if clip else "saved x̂₀ clipping"
        ax.plot([w for w, _ in points], [f for _, f in points], marker="o", ms=4, label=name)
    fidelity = {(c, w): f for c, w, f in cells}
    if floor is not None:
        ax.axhline(floor, color="grey", ls="--", lw=1, label=f"floor {floor:g} %")
    if kept:
        ax.scatter([w for _, w in kept], [fidelity[k] for k in kept], s=140, facecolors="none",
                   edgecolors="black", label="kept", zorder=3)  # fmt: skip
    if chosen is not None:
        ax.scatter([chosen[1]], [fidelity[chosen]], s=220, marker="*", color="tab:red",
                   label=chosen_label, zorder=4)  # fmt: skip
    ax.set(xlabel="guidance weight w", ylabel="endpoint fidelity (%)")
    ax.legend(fontsize=7)


def guidance_cells(
    cells: Sequence[tuple[str | None, float, float]], path: Path, *, title: str, **marks
) -> Path:
    """draw_guidance_cells into `path` (`marks`: its floor, kept, chosen, chosen_label)."""
    fig = _figure(figsize=(6, 4))
    ax = fig.subplots()
    draw_guidance_cells(ax, cells, **marks)
    ax.set_title(title)
    return _save(fig, path)
