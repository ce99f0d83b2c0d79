import numpy as np
from PIL import Image

from pipeline.plots import image_grid, lines, reliability_diagram, scatter


def test_image_grid_places_tiles_exactly(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 3, 4, 5, 3), dtype=np.uint8)
    path = image_grid(images, tmp_path / "g.png", pad=2)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (2 + 2 * 6, 2 + 3 * 7, 3)
    assert np.array_equal(grid[2 + 6 : 2 + 6 + 4, 2 + 2 * 7 : 2 + 2 * 7 + 5], images[1, 2])
    assert image_grid(images, tmp_path / "h.png").read_bytes() == path.read_bytes()


def test_charts_are_written_deterministically(tmp_path):
    panel = {"acc": [0.0, 0.5, 1.0], "conf": [0.2, 0.5, 0.9], "count": [1, 0, 5], "ece": 3.2}
    a = reliability_diagram({"before TS": panel, "after TS": panel}, tmp_path / "a.png")
    b = reliability_diagram({"before TS": panel, "after TS": panel}, tmp_path / "b.png")
    assert a.read_bytes() == b.read_bytes() and Image.open(a).size[0] > 400
    s = scatter(
        [0, 0.5, 1], [0.1, 0.4, 0.9], tmp_path / "s.png", xlabel="α", ylabel="λ̂", diagonal=True
    )
    q = lines({"q": [0.9, 0.8, 0.85]}, tmp_path / "q.png", xlabel="epoch")
    assert Image.open(s).format == Image.open(q).format == "PNG"
