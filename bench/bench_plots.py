"""Charts: what core/plots.py costs per picture, this checkout's and an older one's.

    python -m bench plots                                # this checkout alone
    SEMIX_BEFORE=/tmp/before python -m bench plots       # + an older one (`git archive 7b450c4`)

Evaluate writes a reliability diagram per run (reliability.png: before / after TS, 15 bins), and
every train and finetune run its per-epoch curves (curves.png, core.plots.lines); the test tier
draws dozens of each. Each checkout runs CODE in a fresh process (PYTHONPATH = the checkout,
one thread), in turn, after one untimed process that loads matplotlib's font cache (built there
if missing, so that neither side pays for it): the import of matplotlib once (cold, after numpy
and core.plots, as a stage has them), then per chart one warm-up (the first one's time is kept:
it holds that checkout's lazy imports of matplotlib's modules and the first font load) and the
fastest of REPEATS draws, each drawn and saved as a PNG the way the stage writes it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import REPO

REPEATS = 5

# `python -c CODE <out folder> <repeats>` in a checkout: one JSON line, "PLOTS {...}". The charts'
# data are fixed (the shapes a digits run gives: 1,797 test images over 15 bins, 20 epochs).
CODE = """
import json, sys, time
from pathlib import Path
import numpy as np
from PIL import Image
from core import plots
t = time.perf_counter()
import matplotlib
out = {"import": time.perf_counter() - t}
folder, repeats = Path(sys.argv[1]), int(sys.argv[2])
centres = (np.arange(15) + 0.5) / 15
count = np.array([0, 0, 1, 3, 4, 6, 8, 9, 12, 15, 20, 28, 45, 110, 1536])
empty = np.where(count == 0, np.nan, 0.0)
shift = np.where(np.arange(15) % 2, 0.03, -0.04)
reliability = {
    "before TS": {"acc": list(centres - 0.08 + empty), "conf": list(centres + empty),
                  "count": list(count), "ece": 6.42},
    "after TS": {"acc": list(centres + shift + empty), "conf": list(centres + empty),
                 "count": list(count), "ece": 1.87},
}
epochs = np.arange(20)
history = {"val acc (%)": list(90 + 8 * (1 - np.exp(-epochs / 4))),
           "val ECE (%)": list(6 * np.exp(-epochs / 6) + 1)}
charts = {
    "reliability": lambda p: plots.reliability_diagram(reliability, p, title="r0"),
    "lines": lambda p: plots.lines(history, p, xlabel="epoch", title="r0 (ce)"),
}
for name, draw in charts.items():
    seconds = []
    for i in range(1 + repeats):
        t = time.perf_counter()
        path = draw(folder / f"{name}-{i}.png")
        seconds.append(time.perf_counter() - t)
    with Image.open(path) as image:
        size = image.size
    out[name] = {"first": seconds[0], "best": min(seconds[1:]), "px": size,
                 "bytes": path.stat().st_size}
print("PLOTS " + json.dumps(out))
"""

# the rows: (what, the key in CODE's JSON, the field of that key)
ROWS = (
    ("import matplotlib (cold, once)", "import", None),
    ("first chart: reliability diagram with its lazy imports", "reliability", "first"),
    (f"reliability diagram, 2 panels x 15 bins (best of {REPEATS})", "reliability", "best"),
    (f"curves.png (lines), 2 series x 20 epochs (best of {REPEATS})", "lines", "best"),
)


def measure(code: Path, folder: Path, repeats: int = REPEATS) -> dict:
    """CODE's JSON from a fresh process in checkout `code`, its PNGs written under `folder`."""
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", CODE, str(folder), str(repeats)]
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("PLOTS ")]
    if done.returncode or not lines:
        raise RuntimeError(f"bench plots in {code} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("PLOTS "))


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms"


def rows(sides: dict[str, dict]) -> list[dict]:
    """One row per measure, one column per checkout, and before / now where both ran; then
    each chart's PNG (pixels, bytes), which shows a crop that changed."""
    out = []
    for what, key, field in ROWS:
        seconds = {side: m[key] if field is None else m[key][field] for side, m in sides.items()}
        row = {"measure": what, **{side: _ms(s) for side, s in seconds.items()}}
        if len(sides) == 2:
            row["before / now"] = f"{seconds['before'] / seconds['now']:.2f}x"
        out.append(row)
    for chart in ("reliability", "lines"):
        row = {"measure": f"{chart}: PNG size"}
        for side, m in sides.items():
            (w, h), size = m[chart]["px"], m[chart]["bytes"]
            row[side] = f"{w}x{h} px, {size / 1000:.0f} kB"
        out.append(row | ({"before / now": ""} if len(sides) == 2 else {}))
    return out


def run() -> dict:
    before = os.environ.get("SEMIX_BEFORE")
    checkouts = {"before": Path(before).resolve()} if before else {}
    checkouts["now"] = REPO
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-plots-"))
    try:
        fonts = [sys.executable, "-c", "import matplotlib.font_manager"]
        subprocess.run(fonts, check=True, capture_output=True)  # the font cache, untimed
        sides = {side: measure(code, tmp / side) for side, code in checkouts.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notes = [
        "Each checkout in a fresh process with OMP_NUM_THREADS=1, in turn (before first), after "
        "one untimed process that loaded matplotlib's font cache. import matplotlib: timed once, "
        "after numpy and core.plots. Each chart: one warm-up draw (the reliability diagram's, "
        "the process's first chart, is its own row: the lazy imports of matplotlib's modules "
        f"and the first font load), then the fastest of {REPEATS} draws, each drawn and saved "
        "as a PNG (core.plots' _save, written to a temporary name and renamed).",
        "Data: a digits-sized evaluation (1,797 test images over 15 equal-width bins, two empty; "
        "before TS over-confident, after TS both ways), training_run's curves.png (val acc and "
        "ECE over 20 epochs).",
    ]
    if not before:
        notes.append("No before: set SEMIX_BEFORE to an older checkout (e.g. `git archive "
                     "7b450c4 | tar -x -C /tmp/before`) to compare against.")  # fmt: skip
    else:
        notes.insert(0, f"Sitting: before = {checkouts['before']} (SEMIX_BEFORE), now = this "
                        "checkout.")  # fmt: skip
    return {"title": TITLE, "rows": rows(sides), "notes": notes}


TITLE = "Charts: reliability diagram and per-epoch curves, before and now"
