import numpy as np
from PIL import Image

from core import plots
from core.plots import image_grid, lines, reliability_diagram, scatter


def test_image_grid_places_tiles_exactly(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 3, 4, 5, 3), dtype=np.uint8)
    path = image_grid(images, tmp_path / "g.png", pad=2)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (2 + 2 * 6, 2 + 3 * 7, 3)
    assert np.array_equal(grid[2 + 6 : 2 + 6 + 4, 2 + 2 * 7 : 2 + 2 * 7 + 5], images[1, 2])
    assert image_grid(images, tmp_path / "h.png").read_bytes() == path.read_bytes()


def test_charts_are_deterministic_and_change_with_their_data(tmp_path):
    """Same input, same bytes (no time stamps); other data, other bytes (the chart draws it);
    seeded jitter follows its seed; one column per reliability panel; no temp file left."""
    panel = {"acc": [0.0, 0.5, 1.0], "conf": [0.2, 0.5, 0.9], "count": [1, 0, 5], "ece": 3.2}
    other = dict(panel, acc=[0.0, 0.5, 0.4])

    def png(name, draw, *args, **kwargs) -> bytes:
        return draw(*args, tmp_path / name, **kwargs).read_bytes()

    two = {"before TS": panel, "after TS": panel}
    a = png("a.png", reliability_diagram, two)
    assert a == png("b.png", reliability_diagram, two)
    assert a != png("c.png", reliability_diagram, {"before TS": panel, "after TS": other})
    one = Image.open(reliability_diagram({"before TS": panel}, tmp_path / "one.png")).size[0]
    assert 1.7 < Image.open(tmp_path / "a.png").size[0] / one < 2.3
    xy = ([0, 0.5, 1], [0.1, 0.4, 0.9])
    kw = dict(xlabel="α", ylabel="λ̂", diagonal=True)
    s = png("s1.png", scatter, *xy, **kw, jitter=0.05, seed=1)
    assert s == png("s2.png", scatter, *xy, **kw, jitter=0.05, seed=1)
    assert s != png("s3.png", scatter, *xy, **kw, jitter=0.05, seed=2)
    assert png("s4.png", scatter, *xy, **kw, seed=1) == png("s5.png", scatter, *xy, **kw, seed=2)
    q = png("q1.png", lines, {"q": [0.9, 0.8, 0.85]}, xlabel="epoch")
    assert q == png("q2.png", lines, {"q": [0.9, 0.8, 0.85]}, xlabel="epoch")
    assert q != png("q3.png", lines, {"q": [0.9, 0.8, 0.95]}, xlabel="epoch")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _drawn(monkeypatch) -> list:
    """Every figure a chart saves, as matplotlib left it just before saving (then saved)."""
    figures = []
    save = plots._save

    def keep(fig, path):
        figures.append(
            [
                {
                    "title": ax.get_title(),
                    "legend": [t.get_text() for t in ax.get_legend().get_texts()]
                    if ax.get_legend()
                    else [],
                    "texts": [t.get_text() for t in ax.texts],
                    "x": [list(line.get_xdata()) for line in ax.get_lines()],
                }
                for ax in fig.axes
            ]
        )
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_reliability_diagram_has_the_whole_legend_bin_counts_and_ece_in_percent(
    tmp_path, monkeypatch
):
    """Every panel names both gap colours (a panel with over-confident bins only, too), the
    diagonal and the accuracy bars; each histogram bar carries its count (empty bins none);
    the ECE in the title says %."""
    figures = _drawn(monkeypatch)
    over_only = {"acc": [0.1, 0.4, 0.7], "conf": [0.2, 0.5, 0.9], "count": [3, 0, 1234]}
    mixed = {"acc": [0.3, 0.5, 0.8], "conf": [0.2, 0.5, 0.9], "count": [7, 12, 40], "ece": 3.2}
    reliability_diagram(
        {"before TS": over_only | {"ece": 12.346}, "after TS": mixed}, tmp_path / "r.png"
    )
    top_left, top_right, hist_left, hist_right = figures[0]  # axes: row by row
    legend = [
        "accuracy",
        "gap: confidence > accuracy",
        "gap: accuracy > confidence",
        "perfect calibration",
    ]
    assert top_left["legend"] == top_right["legend"] == legend
    assert top_left["title"] == "before TS  (ECE 12.35 %)"
    assert top_right["title"] == "after TS  (ECE 3.20 %)"
    assert hist_left["texts"] == ["3", "", "1.2k"] and hist_right["texts"] == ["7", "12", "40"]


def test_per_epoch_curves_count_epochs_from_one(tmp_path, monkeypatch):
    figures = _drawn(monkeypatch)
    lines({"val acc (%)": [50.0, 60.0, 70.0]}, tmp_path / "c.png", xlabel="epoch")
    assert figures[0][0]["x"] == [[1, 2, 3]]


def test_a_laid_out_chart_keeps_its_size_and_one_without_grows_to_its_text(tmp_path):
    """The reliability diagram (constrained layout) is saved at its own size, 4 in wide per
    panel and 5.5 in tall at 120 dpi; a chart with fixed margins is cropped to what it draws,
    so a title longer than its page widens the picture instead of being cut off."""
    panel = {"acc": [0.0, 0.5, 1.0], "conf": [0.2, 0.5, 0.9], "count": [1, 0, 5], "ece": 3.2}
    two = reliability_diagram({"before TS": panel, "after TS": panel}, tmp_path / "r.png", "run")
    assert Image.open(two).size == (960, 660)
    q = {"q": [0.9, 0.8, 0.85]}
    short = Image.open(lines(q, tmp_path / "s.png", xlabel="epoch", title="q")).size[0]
    long = Image.open(lines(q, tmp_path / "l.png", xlabel="epoch", title="q " * 80)).size[0]
    assert short < 5 * 120 < long
