"""`semix evaluate` end to end, an older checkout against this one, on a digits run and on a
Fashion-MNIST run (the study's evaluate: real/test + real/val, corruptions, OOD).

    SEMIX_BEFORE=/tmp/before python -m bench evaluate    # /tmp/before = `git archive 7b450c4`

1. Roots (made by this checkout, untimed): digits (prepare, one train run at the preset's
   settings); Fashion-MNIST (the Debian files when installed, else sklearn's digits upscaled
   with noise, as bench/bench_train.py's sitting: prepare, the shift stage's corruptions of
   SHIFT_IMAGES test images, the OOD sets, one ce run).
2. Timing, alone, one thread: each checkout's `python -m pipeline evaluate` as a fresh process
   (wall time with its start), in turn, REPEATS times each; the fastest of each is compared.
   The eval/ folder is removed before every run (an evaluation of the same inputs is otherwise
   skipped as up to date).
3. Agreement: every number of the two checkouts' metrics.json (before_ts, after_ts, posthoc,
   corruptions, ood), the largest absolute difference, and the keys that differ by more than
   1e-4, so a speed-up that moved a result shows next to its time.
4. Shares: one more evaluate of each checkout with its parts timed in CPU seconds (SHARES_CODE:
   the stage's functions wrapped, no profiler), as shares of the process's CPU time: what
   is left to cut, and what a change cut, read on a machine where seconds vary.
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
from bench.bench_train import SHIFT_IMAGES, _fashion_idx, _timed

REPEATS = 3
TOLERANCE = 1e-4

# `python -c SHARES_CODE <pipeline args>`: one evaluate with its parts' CPU seconds (process
# time, so that other jobs on the machine do not count), printed as one JSON line at exit. The
# parts are the stage's module attributes, wrapped where a checkout has them; nested calls are
# not subtracted, so the parts are disjoint only as listed (the logits include every set's).
PARTS = (
    ("stages.evaluate.stage", "collect_logits", "logits"),
    ("shards.datasets", "load_split", "splits read"),
    ("stages.evaluate.stage", "fit_posthoc", "post-hoc fits"),
    ("stages.evaluate.stage", "reliability_diagram", "reliability diagram"),
)
SHARES_CODE = f"""
import atexit, functools, importlib, json, runpy, sys, time
cpu = {{}}
PARTS = {PARTS!r}
for module, name, part in PARTS:
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        continue
    def timed(*args, _f=getattr(mod, name), _part=part, **kwargs):
        t = time.process_time()
        try:
            return _f(*args, **kwargs)
        finally:
            cpu[_part] = cpu.get(_part, 0.0) + time.process_time() - t
    setattr(mod, name, functools.wraps(getattr(mod, name))(timed))
atexit.register(lambda: print("SHARES " + json.dumps({{"total": time.process_time(), **cpu}})))
sys.argv = ["pipeline", *sys.argv[1:]]
runpy.run_module("pipeline", run_name="__main__")
"""


def _leaves(tree, path: str = "") -> dict[str, float]:
    """{dotted key: number} of every number in a metrics.json tree."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}.{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}[{i}]").items()}
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return {path.lstrip("."): float(tree)}
    return {}


def _evaluation(root: Path) -> dict[str, float]:
    (metrics,) = root.glob("eval/train/*/metrics.json")
    evaluation = json.loads(metrics.read_text())["evaluation"]
    return _leaves({k: v for k, v in evaluation.items() if k != "code_version"})


def _compare(before: dict[str, float], now: dict[str, float]) -> tuple[float, list[str]]:
    """(largest |difference| over the keys both have, the sections holding keys above
    TOLERANCE with their largest difference and count, and keys in one side only). A section
    is a key less its last part (posthoc.after.dirichlet for posthoc.after.dirichlet.ece)."""
    common = before.keys() & now.keys()
    diff = {k: abs(before[k] - now[k]) for k in common}
    worst = max(diff.values(), default=0.0)
    sections: dict[str, list[float]] = {}
    for key, d in diff.items():
        if d > TOLERANCE:
            sections.setdefault(key.rsplit(".", 1)[0], []).append(d)
    off = [f"{s} ({len(d)} keys, max {max(d):.1e})" for s, d in sorted(sections.items())]
    return worst, off + sorted(f"{k} (one side only)" for k in before.keys() ^ now.keys())


def _shares(cpu: dict[str, float]) -> str:
    """SHARES_CODE's JSON as "logits 59 %, splits read 11 %, ..., the rest 9 % of 36.2 CPU s"."""
    total = cpu.pop("total")
    parts = [f"{part} {100 * s / total:.0f} %" for part, s in cpu.items()]
    rest = total - sum(cpu.values())
    return ", ".join([*parts, f"the rest {100 * rest / total:.0f} %"]) + f" of {total:.1f} CPU s"


def _sitting(before: Path, tmp: Path, preset: str, sets: list[str]) -> dict:
    """The fastest evaluate of each checkout on one root, their results' agreement, and the
    shares of one more evaluate of each."""
    py = sys.executable
    root = tmp / preset
    args = ["evaluate", "--preset", preset, "--set", f"out={tmp}", "run=r0", "stage_dir=train"]

    def evaluate(code: Path) -> tuple[float, dict[str, float]]:
        shutil.rmtree(root / "eval", ignore_errors=True)
        seconds = _timed([py, "-m", "pipeline", *args, *sets], code)
        return seconds, _evaluation(root)

    def shares(code: Path) -> str:
        shutil.rmtree(root / "eval", ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
        env["SEMIX_NO_PROGRESS"] = "1"
        cmd = [py, "-c", SHARES_CODE, *args, *sets]
        done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("SHARES ")]
        if done.returncode or not lines:
            raise RuntimeError(f"evaluate with shares failed:\n{done.stderr[-2000:]}")
        return _shares(json.loads(lines[-1].removeprefix("SHARES ")))

    befores, nows = [], []
    for _ in range(REPEATS):
        befores.append(evaluate(before))
        nows.append(evaluate(REPO))
    t_before, t_now = min(s for s, _ in befores), min(s for s, _ in nows)
    worst, off = _compare(befores[0][1], nows[0][1])
    share_before, share_now = shares(before), shares(REPO)
    return {
        "run": preset,
        "before s": f"{t_before:.1f}",
        "now s": f"{t_now:.1f}",
        "x before": f"{t_before / t_now:.2f}",
        "max |Δ| of a metric": f"{worst:.1e}",
        "above 1e-4": "; ".join(off) if off else "none",
        "all s": f"before {', '.join(f'{s:.1f}' for s, _ in befores)}; "
        f"now {', '.join(f'{s:.1f}' for s, _ in nows)}",
        "shares before": share_before,
        "shares now": share_now,
    }


def run() -> dict | None:
    before = os.environ.get("SEMIX_BEFORE")
    if not before:
        print("bench evaluate: set SEMIX_BEFORE to an older checkout (e.g. `git archive 7b450c4 "
              "| tar -x -C /tmp/before`) to compare against; section kept")  # fmt: skip
        return None
    before_path = Path(before).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-evaluate-"))
    py = sys.executable

    def stage(preset: str, name: str, *sets: str) -> float:
        cmd = [py, "-m", "pipeline", name, "--preset", preset, "--set", f"out={tmp}", *sets]
        return _timed(cmd, REPO)

    try:
        # 1. The roots, by this checkout.
        stage("digits", "prepare")
        stage("digits", "train", "run=r0")
        idx = _fashion_idx(tmp / "idx")
        stage("fashion-mnist", "prepare", f"data_dir={idx}")
        stage("fashion-mnist", "shift", f"limit={SHIFT_IMAGES}")
        stage("fashion-mnist", "ood")
        stage("fashion-mnist", "train", "run=r0", "seed=1", "loss=ce")
        fashion = tmp / "fashion-mnist"
        ood = ",".join(str(fashion / "ood" / s) for s in ("digits", "uniform"))
        study = [f"corruptions={fashion / 'shift' / 'test-c'}", f"ood={ood}", "ts_criterion=nll"]
        # 2-3. Each checkout in turn, timed; the results compared.
        rows = [
            _sitting(before_path, tmp, "digits", []),
            _sitting(before_path, tmp, "fashion-mnist", study),
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notes = [
        f"Sitting: before = {before_path} (SEMIX_BEFORE), now = this checkout, in turn on one "
        f"root, {REPEATS} times each, the fastest compared; each a fresh process with "
        "OMP_NUM_THREADS=1 (wall time with its start, data decode, logits, post-hoc "
        "calibrators, metrics, the reliability diagram, outputs).",
        "digits: real/test + real/val of the digits preset (one run trained at its settings). "
        f"fashion-mnist: real/test + real/val, the shift stage's corruptions x 5 severities of "
        f"{SHIFT_IMAGES} test images and two OOD sets (digits, uniform), ts_criterion=nll "
        "(the study's evaluate).",
        f"Data: {'Debian' if idx.parts[1] == 'usr' else 'sklearn digits at 28x28 with noise'} "
        "(Fashion-MNIST's shapes and sizes).",
        "Agreement: every number of metrics.json's evaluation (percentages x100), before "
        "against now; sections with a key above 1e-4 are named. A post-hoc fit that does not "
        "reach the gradient tolerance (dirichlet at the L-BFGS cap on a small val or on a flat "
        "valley; vector scaling on a val fold where a class has no error) stops where rounding "
        "led it, in either checkout, ~1e-3 apart in probability: see docs/evaluate.md.",
        "Shares: one more evaluate of each checkout, its parts in CPU seconds (process time) as "
        "shares of the process's: logits = every set's forward passes (test, val, each "
        "corruption and severity, OOD); splits read = real/test, real/val and the OOD splits "
        "read and their PNGs decoded; the rest = start-up and imports, model loading, metrics, "
        "outputs.",
    ]
    return {"title": TITLE, "rows": rows, "notes": notes}


TITLE = "Evaluate: before and now, digits and Fashion-MNIST"
