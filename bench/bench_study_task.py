"""A study task against the bench's stacked run: one study-style stacked train command, alone
and beside a second job, with where its time goes.

    python -m bench study-task                                  # this checkout
    SEMIX_BEFORE=/tmp/before python -m bench study-task         # + an older one, in turn

The verdict study's stacked runs took twice the bench's rate (bench/RESULTS.md, "Study
classifier": 20.8 s a run in a stack of 5, alone; the study's train-ce 42.7 s a run, train-csm
87 s). This bench times the study's own command, `python -m pipeline train --preset
fashion-mnist --set run=<loss> seeds=1,...,K loss=<loss>`, each a fresh process with the
environment the study gives it (pipeline/study/execute.py `task_env` where the checkout has
it), in these modes:

1. alone;
2. beside: two identical commands at once (the study's `jobs=2` on 2 cores);
3. beside-threads: beside a neighbour left at torch's default threads (`cpu_threads=0`, every
   core: what fit-generator runs with), the neighbour stopped once the timed job ends;
4. beside-kept (only when SEMIX_TASK_MODES names it): as 2, both keeping the memory they free
   (GLIBC_TUNABLES mmap and trim thresholds: no page faults for the activation buffers).

Per job: wall, CPU (user + kernel, os.wait4), minor page faults per training step and
involuntary context switches (the scheduler taking the core away: the contention itself).
Breakdown: from SEMIX_PHASES (stages/common/phases.py) where the checkout has it (start and
imports, data, models, steps, validation, checkpoints, metrics, outputs), else from the run's
own records (steps: host.json's seconds per epoch; the rest together). FLOPs per run (one
step of the objective's forward and backward by torch.utils.flop_counter, and validation's
logits) make ce and csm comparable: csm's step also runs the network on 2 mixed images per
real one, 3x ce's work.

Sizes (environment): SEMIX_TASK_LOSSES (default "ce,csm"), SEMIX_TASK_SEEDS_CE (10, the
verdict study's train-ce), SEMIX_TASK_SEEDS_CSM (4, its train-csm), SEMIX_TASK_EPOCHS (the
preset's 20), SEMIX_TASK_MODES ("alone,beside,beside-threads"), SEMIX_TASK_OUT (a folder to
keep the root in and reuse: prepare is skipped when its real/ is complete). The mixed set for
csm is 720 series x 8 members of pixel blends of two real images (the study's 45 pairs x 16),
the same shapes and count as the study's generated one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench import REPO
from shards.manifest import read_manifest

PRESET = "fashion-mnist"
KEPT = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"
PHASES = ("open", "data", "models", "steps", "validation", "checkpoint", "report", "outputs")
PAIRS, SERIES_PER_PAIR, MEMBERS = 45, 16, 8  # the study's mixed set: 720 series, 5,760 images


def _env_list(name: str, default: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, default).split(",") if v.strip()]


# ---------------------------------------------------------------- the root


def make_root(out: Path, losses: list[str]) -> Path:
    """out/fashion-mnist with real/ (prepared by this checkout, untimed) and, for csm, mixed/."""
    from bench.bench_train import _fashion_idx
    from shards.manifest import is_complete

    root = out / PRESET
    if not all(is_complete(root / "real" / s) for s in ("train", "val", "test")):
        idx = out / "idx" if (out / "idx").is_dir() else _fashion_idx(out / "idx")
        cmd = [sys.executable, "-m", "pipeline", "prepare", "--preset", PRESET, "--set"]
        subprocess.run([*cmd, f"out={out}", f"data_dir={idx}"], cwd=REPO, check=True)
    if "csm" in losses and not is_complete(root / "mixed"):
        write_blends(root)
    return root


def write_blends(root: Path) -> None:
    """mixed/: per class pair, SERIES_PER_PAIR series of MEMBERS pixel blends of one real image
    of each class (the first 5k of real/train, the study's budget), soft targets from α."""
    from shards.reader import load_split
    from shards.writer import ShardFolder

    split = load_split(root / "real" / "train")
    names = list(split.class_names)
    images, labels = split.images[:5000].numpy(), split.labels[:5000].numpy()
    rng = np.random.default_rng(0)
    pairs = [(a, b) for a in range(len(names)) for b in range(a + 1, len(names))][:PAIRS]
    samples = []
    for sid, (a, b) in enumerate(p for p in pairs for _ in range(SERIES_PER_PAIR)):
        xa = images[rng.choice(np.flatnonzero(labels == a))].astype(float)
        xb = images[rng.choice(np.flatnonzero(labels == b))].astype(float)
        for k in range(MEMBERS):
            alpha = k / (MEMBERS - 1)
            lam = alpha + 0.05 * np.sin(sid + k)
            t_a = float(1 / (1 + np.exp(-4.0 * (lam - 0.5))))
            meta = {"series": sid, "position": k, "classes": [a, b], "names": [names[a], names[b]],
                    "alpha": alpha, "seed": sid, "generator": "blend", "revision": "",
                    "sampler": "none", "steps": 0, "guidance": 0.0, "lambda_hat": lam,
                    "soft": [t_a, 1 - t_a]}  # fmt: skip
            pixels = (alpha * xa + (1 - alpha) * xb).round().astype(np.uint8)
            samples.append({"__key__": f"s{sid:07d}_{k:02d}", "png": pixels,
                            "cls": a if t_a >= 0.5 else b, "json": meta})  # fmt: skip
    shards = ShardFolder(root / "mixed", "mixed")
    chunks = range(0, len(samples), 2000)
    for n, i in enumerate(chunks):
        shards.write(n, samples[i : i + 2000])
    alphas = [k / (MEMBERS - 1) for k in range(MEMBERS)]
    shards.finish(len(chunks), kind="mixed", class_names=names, info={"alphas": alphas})


# ---------------------------------------------------------------- FLOPs of a run


def run_flops(loss: str, epochs: int, train: int, val: int, batch: int = 128) -> float:
    """FLOPs of one run: the steps' forward and backward (csm: the network also on 2 mixed
    images per real one, its own forward) and each epoch's validation logits."""
    from models.classifiers import build_classifier

    model = build_classifier("conv-mlp", 10, 1)

    def counted(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    def step() -> None:
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        loss_value = F.cross_entropy(model(x), y)
        if loss == "csm":
            loss_value = loss_value + model(torch.randn(2 * batch, 1, 28, 28)).square().mean()
        loss_value.backward()

    with torch.no_grad():
        per_image = counted(lambda: model.eval()(torch.randn(64, 1, 28, 28))) / 64
    model.train()
    steps = -(-train // batch)
    return epochs * (steps * counted(step) + val * per_image)


# ---------------------------------------------------------------- the jobs


def task_env(code: Path, argv: list[str]) -> dict[str, str]:
    """The study's environment for `argv` in checkout `code`: its execute.task_env where it
    has one (asked in a subprocess of that checkout), else this process's environment."""
    ask = (
        "import json, sys\n"
        "try:\n"
        "    from pipeline.study.execute import task_env\n"
        "except ImportError:\n"
        "    task_env = None\n"
        "extra = {} if task_env is None else {k: v for k, v in task_env(sys.argv[1:]).items()"
        " if k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')}\n"
        "print(json.dumps(extra))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(code), "SEMIX_NO_PROGRESS": "1"}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "SEMIX_PHASES", "GLIBC_TUNABLES"):
        env.pop(var, None)
    got = subprocess.run([sys.executable, "-c", ask, *argv], cwd=code, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return env | json.loads(got.stdout)


class Job:
    """One train command started now; `wait` gives its wall seconds and rusage."""

    def __init__(self, code: Path, out: Path, run: str, seeds: int, loss: str, epochs: int,
                 log: Path, *extra: str, kept: bool = False) -> None:  # fmt: skip
        sets = [f"out={out}", f"run={run}", f"seeds={','.join(map(str, range(1, seeds + 1)))}",
                f"loss={loss}", f"epochs={epochs}", *extra]  # fmt: skip
        argv = [sys.executable, "-m", "pipeline", "train", "--preset", PRESET, "--set", *sets]
        env = task_env(code, argv)
        self.phases = log.with_suffix(".phases.json")
        self.phases.unlink(missing_ok=True)
        env["SEMIX_PHASES"] = str(self.phases)
        if kept:
            env["GLIBC_TUNABLES"] = KEPT
        self.folders = [out / PRESET / "train" / f"{run}-s{s}" for s in range(1, seeds + 1)]
        for f in self.folders:
            shutil.rmtree(f, ignore_errors=True)
        self.log, self.env = log, env
        self.t0 = time.time()
        with open(log, "w") as sink:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, cwd=code, env=env, stdout=sink,
                                         stderr=subprocess.STDOUT)  # fmt: skip

    def wait(self) -> dict:
        _, status, usage = os.wait4(self.proc.pid, 0)
        wall = time.time() - self.t0
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        if self.proc.returncode:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.log.name} failed ({self.proc.returncode}):\n{tail}")
        return {"wall": wall, "end": self.t0 + wall, "user": usage.ru_utime,
                "sys": usage.ru_stime, "faults": usage.ru_minflt, "preempted": usage.ru_nivcsw}  # fmt: skip

    def stop(self) -> None:
        """A neighbour's end: stopped once the timed job is done (its outputs are not used)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def breakdown(job: Job, got: dict) -> dict[str, float]:
    """Wall seconds of the job's parts: SEMIX_PHASES where the checkout writes it (start =
    launch to the stage's first line of work, exit = its end to the process's), else the
    runs' own records (steps from host.json; the rest together)."""
    steps = sum(h["seconds"] for f in job.folders
                for h in json.loads((f / "host.json").read_text())["epochs"])  # fmt: skip
    if not job.phases.is_file():
        return {"steps": steps, "rest": got["wall"] - steps}
    record = json.loads(job.phases.read_text())
    parts = {"start": record["start"]["unix"] - job.t0}
    parts |= {k: record["phases"].get(k, {}).get("wall_s", 0.0) for k in PHASES}
    parts["exit"] = got["end"] - record["end"]["unix"]
    parts["other"] = got["wall"] - sum(parts.values())
    return parts


def steps_of(loss: str, seeds: int, epochs: int, train: int = 5000, batch: int = 128) -> int:
    return seeds * epochs * -(-train // batch)


def measure(code: Path, label: str, out: Path, loss: str, seeds: int, epochs: int,
            mode: str, logs: Path) -> dict:  # fmt: skip
    """Run `mode` once; the timed job's numbers (beside: the slower of the two identical)."""
    name = f"{label}-{loss}-{mode}"
    job = Job(code, out, f"{name}-a", seeds, loss, epochs, logs / f"{name}-a.log",
              kept=mode == "beside-kept")  # fmt: skip
    neighbour = None
    if mode in ("beside", "beside-kept"):
        neighbour = Job(code, out, f"{name}-b", seeds, loss, epochs, logs / f"{name}-b.log",
                        kept=mode == "beside-kept")  # fmt: skip
    elif mode == "beside-threads":  # outlasts the timed job; stopped when it ends
        neighbour = Job(code, out, f"{name}-t", 2 * seeds, loss, epochs,
                        logs / f"{name}-t.log", "cpu_threads=0")  # fmt: skip
    got = job.wait()
    timed = [(job, got)]
    if neighbour is not None and mode != "beside-threads":
        timed.append((neighbour, neighbour.wait()))
    elif neighbour is not None:
        neighbour.stop()
    job, got = max(timed, key=lambda jg: jg[1]["wall"])
    got["parts"] = breakdown(job, got)
    print(f"  {name}: {got['wall']:.1f} s, {got['wall'] / seeds:.1f} s a run", flush=True)
    return got


def run() -> dict:
    losses = _env_list("SEMIX_TASK_LOSSES", "ce,csm")
    modes = _env_list("SEMIX_TASK_MODES", "alone,beside,beside-threads")
    epochs = int(os.environ.get("SEMIX_TASK_EPOCHS", "20"))
    seeds = {"ce": int(os.environ.get("SEMIX_TASK_SEEDS_CE", "10")),
             "csm": int(os.environ.get("SEMIX_TASK_SEEDS_CSM", "4"))}  # fmt: skip
    before = os.environ.get("SEMIX_BEFORE")
    checkouts = ([("before", Path(before).resolve())] if before else []) + [("now", REPO)]
    kept_out = os.environ.get("SEMIX_TASK_OUT")
    out = Path(kept_out) if kept_out else Path(tempfile.mkdtemp(prefix="semix-bench-task-"))
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    rows, parts_rows = [], []
    try:
        root = make_root(out, losses)
        val = read_manifest(root / "real" / "val").num_samples
        for loss in losses:
            k = seeds[loss]
            flops = run_flops(loss, epochs, 5000, val)
            alone: dict[str, float] = {}
            for mode in modes:  # a mode's checkouts in turn, so that load drifts hit both
                for label, code in checkouts:
                    got = measure(code, label, out, loss, k, epochs, mode, logs)
                    per_run = got["wall"] / k
                    if mode == "alone":
                        alone[label] = per_run
                    ratio = per_run / alone[label] if label in alone else float("nan")
                    rows.append({
                        "loss": loss, "code": label, "mode": mode, "seeds": k,
                        "wall s": f"{got['wall']:.1f}", "s per run": f"{per_run:.1f}",
                        "x alone": f"{ratio:.2f}",
                        "CPU s (kernel)": f"{got['user'] + got['sys']:.1f} ({got['sys']:.1f})",
                        "faults/step": f"{got['faults'] / steps_of(loss, k, epochs):.0f}",
                        "preempted": got["preempted"],
                        "GFLOP/run": f"{flops / 1e9:.0f}",
                        "GFLOP/s": f"{flops * k / got['wall'] / 1e9:.1f}",
                    })  # fmt: skip
                    parts_rows.append({"loss": loss, "code": label, "mode": mode} |
                                      {p: f"{s:.1f}" for p, s in got["parts"].items()})  # fmt: skip
    finally:
        if not kept_out:
            shutil.rmtree(out, ignore_errors=True)
    columns = ["loss", "code", "mode", "start", *PHASES, "exit", "other", "steps", "rest"]
    parts_rows = [{c: r.get(c, "") for c in columns if any(c in p for p in parts_rows)}
                  for r in parts_rows]  # fmt: skip
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    notes = [
        f"Command per job: `python -m pipeline train --preset {PRESET} --set run=<name> "
        f"seeds=1..K loss=<loss> epochs={epochs}`, a fresh process, the study's environment "
        "(execute.task_env where the checkout has it: OMP_NUM_THREADS=MKL_NUM_THREADS=cpu_threads)"
        f"; modes in turn, each mode's checkouts in turn{'; before = ' + before if before else ''}.",
        "beside: two identical commands at once, the slower one's numbers; beside-threads: "
        "beside the same command at cpu_threads=0 (torch's default, every core: fit-generator's), "
        "stopped when the timed one ends; beside-kept: as beside, with GLIBC_TUNABLES="
        + KEPT
        + ".",
        "faults/step: minor page faults of the whole process per training step; preempted: "
        "involuntary context switches (os.wait4's ru_nivcsw).",
        "Breakdown (wall s): start = launch to the stage's work (interpreter, imports, config); "
        "models includes torch.optim's first import of torch._dynamo; steps and validation "
        "summed over the stack's runs; checkpoint = accelerate's save_state + the checkpoint's "
        "fsyncs; report = metrics.json and host.json each epoch; outputs = weights, metrics, "
        "curves.png, manifest. A checkout without SEMIX_PHASES: steps (host.json) and the rest.",
        f"Transparent huge pages: {thp.read_text().strip() if thp.is_file() else 'unknown'}; "
        f"load average at the end: {os.getloadavg()[0]:.2f}.",
    ]
    return {"title": TITLE, "rows": rows, "tables": {BREAKDOWN: parts_rows}, "notes": notes}


TITLE = "A study task: the stacked train command alone and beside a second job"
BREAKDOWN = "Where a job's wall goes (s)"
