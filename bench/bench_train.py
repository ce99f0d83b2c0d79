"""The study classifier against the machine: a measured roofline, and runs per core-hour.

    python -m bench train                                # roofline only
    SEMIX_BEFORE=/tmp/before python -m bench train       # + the sitting against another checkout

1. Roofline (one thread, in this process): the study classifier (`conv-mlp`, Fashion-MNIST's
   28x28 grey, batch 128) -- FLOPs of one training step counted by torch.utils.flop_counter,
   the step timed in its parts (data: index + flip + normalise; forward; backward; optimizer),
   the achieved GFLOP/s against this machine's measured peak (a 2048^3 matmul, same dtype, same
   thread count); the same for evaluation's logits (batch 512). Rows for the layouts and dtypes
   tried, and for K seeds stacked into one network by torch.func (vmap), the alternative to
   the stack's runs in turn (stages/train.py, `run_stack`).
2. Sitting (with SEMIX_BEFORE = a checkout of an older commit, e.g. `git archive 40d77dd | tar
   -x -C /tmp/before`): a Fashion-MNIST-shaped root (the Debian files when installed, else
   sklearn's digits upscaled to 28x28 with noise: the same shapes, sizes and so the same work),
   then, alone, one thread each: the study's train run (ce, 20 epochs over 5k) by the older
   checkout, one by this one, a stack of STACK seeds by this one; evaluate (test + val) by
   each. Runs per core-hour = runs / (wall seconds x threads) x 3600.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench import REPO
from core.io import read_json
from models.classifiers import build_classifier
from models.training import (
    CPU_PASS,
    collect_logits,
    inference_copy,
    is_channels_last,
    normalize,
    random_crop_flip,
)

BATCH, EVAL_BATCH, CLASSES = 128, 512, 10
REPEATS = 3  # one-run-per-process timings of each checkout
STACK = 5  # seeds in the sitting's stack
SHIFT_IMAGES = 2000  # test images per corruption and severity, as the study's robustness table


def _best(fn, repeats: int = 5, number: int = 10) -> float:
    """Best mean seconds per call over `repeats` rounds of `number` calls (after a warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def peak_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best(lambda: a @ b, repeats=3, number=3) / 1e9


class Step:
    """One training step of the study classifier, in its four parts."""

    def __init__(self, channels_last: bool, bf16: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.model = build_classifier("conv-mlp", CLASSES, 1)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.cl, self.bf16 = is_channels_last(self.model), bf16
        self.opt = torch.optim.SGD(
            self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4
        )
        self.images = torch.randint(0, 256, (5000, 28, 28, 3), generator=g, dtype=torch.uint8)
        self.labels = torch.randint(0, CLASSES, (5000,), generator=g)
        self.mean, self.std = torch.tensor([0.29]), torch.tensor([0.35])
        self.g = g

    def data(self):
        idx = torch.randint(0, 5000, (BATCH,), generator=self.g)
        images = random_crop_flip(self.images[idx], self.g, pad=0, flip=True)
        x = normalize(images, self.mean, self.std, 28, channels_last=self.cl)
        return x, self.labels[idx]

    def forward(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return F.cross_entropy(self.model(x), y)

    def backward(self, loss) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)

    def step(self) -> None:
        self.opt.step()

    def flops(self) -> int:
        x, y = self.data()
        with FlopCounterMode(display=False) as counter:
            self.backward(self.forward(x, y))
        return counter.get_total_flops()

    def split(self, steps: int = 30) -> dict[str, float]:
        """Best-of-3 seconds per step of each part (each part timed around its own calls)."""
        for _ in range(5):
            x, y = self.data()
            self.backward(self.forward(x, y))
            self.step()
        best: dict[str, float] = {}
        for _ in range(3):
            t = dict.fromkeys(("data", "forward", "backward", "optimizer"), 0.0)
            for _ in range(steps):
                t0 = time.perf_counter()
                x, y = self.data()
                t1 = time.perf_counter()
                loss = self.forward(x, y)
                t2 = time.perf_counter()
                self.backward(loss)
                t3 = time.perf_counter()
                self.step()
                t4 = time.perf_counter()
                for k, a, b in (("data", t0, t1), ("forward", t1, t2)):
                    t[k] += b - a
                t["backward"] += t3 - t2
                t["optimizer"] += t4 - t3
            if not best or sum(t.values()) < sum(best.values()):
                best = t
        return {k: v / steps for k, v in best.items()}


def _train_row(name: str, step: Step, peak: float) -> dict:
    flops = step.flops()
    parts = step.split()
    total = sum(parts.values())
    gflops = flops / total / 1e9
    return {
        "training step (batch 128)": name,
        "img/s per core": f"{BATCH / total:,.0f}",
        "MFLOP/img": f"{flops / BATCH / 1e6:.1f}",
        "GFLOP/s": f"{gflops:.1f}",
        "peak GFLOP/s": f"{peak:.0f}",
        "share": f"{100 * gflops / peak:.1f} %",
        "data / fwd / bwd / opt (ms)": " / ".join(f"{1e3 * v:.1f}" for v in parts.values()),
    }


def _vmap_row(k: int, peak: float) -> dict:
    """K conv-mlps stacked by torch.func (stack_module_state + vmap over functional_call)."""
    from copy import deepcopy

    from torch.func import functional_call, stack_module_state, vmap

    nets = [build_classifier("conv-mlp", CLASSES, 1) for _ in range(k)]
    params, buffers = stack_module_state(nets)
    base = deepcopy(nets[0]).to("meta")
    opt = torch.optim.SGD(list(params.values()), lr=0.05, momentum=0.9)
    x, y = torch.randn(k, BATCH, 1, 28, 28), torch.randint(0, CLASSES, (k, BATCH))

    def loss(p, b, xs, ys):
        return F.cross_entropy(functional_call(base, (p, b), (xs,)), ys)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        vmap(loss, randomness="different")(params, buffers, x, y).sum().backward()
        opt.step()

    seconds = _best(step, repeats=2, number=3)
    return {
        "training step (batch 128)": f"{k} seeds stacked by torch.func.vmap (fp32)",
        "img/s per core": f"{k * BATCH / seconds:,.0f}",
        "MFLOP/img": "",
        "GFLOP/s": "",
        "peak GFLOP/s": f"{peak:.0f}",
        "share": "",
        "data / fwd / bwd / opt (ms)": "",
    }


def _eval_row(name: str, how: str, peak: float) -> dict:
    """Validation's logits of 6,000 images: `plain` (eval mode, NCHW, BatchNorm its own pass,
    passes of 512), `folded` (inference_copy, passes of 512) or `now` (collect_logits: folded,
    passes of at most CPU_PASS on a CPU)."""
    model = build_classifier("conv-mlp", CLASSES, 1).eval()
    images = torch.randint(0, 256, (6000, 28, 28, 3), dtype=torch.uint8)
    x = normalize(images[:EVAL_BATCH], [0.29], [0.35])
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(x)
    flops = counter.get_total_flops() / EVAL_BATCH

    def passes(net: torch.nn.Module, cl: bool) -> None:
        with torch.inference_mode():
            for s in range(0, len(images), EVAL_BATCH):
                batch = images[s : s + EVAL_BATCH]
                net(normalize(batch, [0.29], [0.35], channels_last=cl))

    folded = inference_copy(model)
    run = {
        "plain": lambda: passes(model, False),
        "folded": lambda: passes(folded, True),
        "now": lambda: collect_logits(model, images, [0.29], [0.35], batch_size=EVAL_BATCH),
    }[how]
    seconds = _best(run, repeats=3, number=1)
    rate = len(images) / seconds
    return {
        "evaluation logits (fp32)": name,
        "img/s per core": f"{rate:,.0f}",
        "MFLOP/img": f"{flops / 1e6:.2f}",
        "GFLOP/s": f"{flops * rate / 1e9:.1f}",
        "share": f"{100 * flops * rate / 1e9 / peak:.1f} %",
    }


def gpu_row() -> dict:
    """ResNet-18 on CIFAR-sized images (32x32, batch 512), bf16 autocast + channels_last, on
    the GPU (what docs/scale.md's cost model reads where a GPU is lent)."""
    dev = torch.device("cuda")
    model = build_classifier("resnet18", CLASSES, 3).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(512, 3, 32, 32, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, CLASSES, (512,), device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    seconds = _best(step, repeats=3, number=10)
    return {
        "training step (batch 128)": f"GPU: resnet18, 32x32, batch 512, bf16 + channels_last "
        f"({torch.cuda.get_device_name(0)})",
        "img/s per core": f"{512 / seconds:,.0f} (per GPU)",
        **dict.fromkeys(("MFLOP/img", "GFLOP/s", "peak GFLOP/s", "share"), ""),
        "data / fwd / bwd / opt (ms)": "",
    }


def roofline() -> tuple[list[dict], list[dict], list[str]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = peak_gflops(torch.float32), peak_gflops(torch.bfloat16)
        train = [
            _train_row("NCHW, fp32 (the layout before)", Step(channels_last=False), fp32),
            _train_row("channels_last, fp32 (auto without native bf16)", Step(True), fp32),
            _train_row("now: channels_last, bf16 autocast (auto here)", Step(True, True), bf16),
            _vmap_row(4, fp32),
        ]
        evals = [
            _eval_row("eval mode, NCHW, passes of 512 (before)", "plain", fp32),
            _eval_row("BN folded, channels_last, passes of 512", "folded", fp32),
            _eval_row(f"now: BN folded, channels_last, passes of {CPU_PASS}", "now", fp32),
        ]
    finally:
        torch.set_num_threads(threads)
    if torch.cuda.is_available():
        train.append(gpu_row())
    notes = [
        f"Peak: a 2048^3 matmul on one thread, {fp32:.0f} GFLOP/s fp32, {bf16:.0f} GFLOP/s bf16 "
        "(a reference, not a ceiling: oneDNN's folded convolutions in cache-sized passes can "
        "pass it).",
        "What it shows: NCHW BatchNorm, ReLU and max-pool over the 28x28x32 activations cost "
        "more than the convolutions; channels_last (oneDNN's layout) halves the step, and "
        "folding BatchNorm into the convolutions for evaluation triples the logits' rate. "
        "K seeds as one vmapped network are slower per image than K steps of one (the "
        "batched BatchNorm and convolutions fall off oneDNN's fast paths), so a stack takes "
        "its runs' epochs in turn (stages/train.py, run_stack).",
        "precision=auto is bf16 autocast on a CPU that computes bf16 natively (AVX512-BF16 or "
        "AMX; this one does): the bf16 row is the step a run takes here, the fp32 row the one "
        "it takes on other CPUs. Validation and evaluation logits stay fp32; a pass of "
        f"{CPU_PASS} images keeps the 28x28x32 activations in the core's cache (2x a pass of "
        f"{EVAL_BATCH}).",
        "Largest remaining loss: of a stacked run's ~20 s, the steps take ~14 s at 23 % of the "
        "bf16 peak (max-pool, BatchNorm and ReLU over the 28x28x32 activations, forward and "
        "backward, are memory-bound; the convolutions are a third of the step) and validation "
        "~5.6 s (6,001 fp32 logits x 20 epochs, at the fp32 peak: only fewer validations "
        "would cut it).",
        "Step parts timed around their own calls, best of 3 x 30 steps; data = index, flip and "
        "normalise of uint8 images already in memory; backward includes the grad-norm clip.",
    ]
    return train, evals, notes


# ---------------------------------------------------------------- the sitting


def _fashion_idx(folder: Path) -> Path:
    """Fashion-MNIST-shaped IDX files: Debian's when installed, else sklearn's digits upscaled."""
    debian = Path("/usr/share/datasets/fashion-mnist")
    if debian.is_dir():
        return debian
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16
    big = F.interpolate(small, size=(28, 28), mode="bilinear")[:, 0].numpy()
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for split, n in (("train", 60000), ("t10k", 10000)):
        i = rng.integers(0, len(big), n)
        noisy = big[i] * 255 + rng.normal(0, 20, (n, 28, 28))
        arrays = {"images-idx3": np.clip(noisy, 0, 255).astype(np.uint8)}
        arrays["labels-idx1"] = digits.target[i].astype(np.uint8)
        for kind, a in arrays.items():
            head = bytes([0, 0, 8, a.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in a.shape)
            (folder / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(head + a.tobytes(), 1))
    return folder


STACK_CODE = """
import sys
from core.logs import setup_logging
from pipeline.registry import run_train_stack
setup_logging()
out, n = sys.argv[1], int(sys.argv[2])
run_train_stack("fashion-mnist", [[f"out={out}", f"run=ce-s{s}", f"seed={s}", "loss=ce"]
                                  for s in range(1, n + 1)])
"""


def _timed(cmd: list[str], code: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "SEMIX_NO_PROGRESS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed:\n{done.stderr[-2000:]}")
    seconds = time.perf_counter() - t0
    print(f"  {code.name}: {' '.join(cmd[2:5])} ... {seconds:.1f} s", flush=True)
    return seconds


def sitting(before: Path, tmp: Path) -> tuple[list[dict], list[str]]:
    """Runs per core-hour and evaluation seconds, the older checkout's and this one's, in turn
    on one root (prepared, shifted and OOD sets made by this checkout, untimed)."""
    py = sys.executable
    idx = _fashion_idx(tmp / "idx")
    root = tmp / "fashion-mnist"

    def stage(code: Path, name: str, *sets: str) -> float:
        cmd = [py, "-m", "pipeline", name, "--preset", "fashion-mnist", "--set", f"out={tmp}"]
        return _timed([*cmd, *sets], code)

    stage(REPO, "prepare", f"data_dir={idx}")
    stage(REPO, "shift", f"limit={SHIFT_IMAGES}")
    stage(REPO, "ood")
    ood = ",".join(str(root / "ood" / s) for s in ("digits", "uniform"))
    shifted = [f"corruptions={root / 'shift' / 'test-c'}", f"ood={ood}", "ts_criterion=nll"]

    # one run, REPEATS times each, in turn: the older checkout's time has varied 1.5x between
    # runs (68-100 s), so the fastest of each is compared (the one most in the older one's favour)
    befores, nows = [], []
    for i in range(REPEATS):
        befores.append(stage(before, "train", f"run=before-{i}", "seed=1", "loss=ce"))
        nows.append(stage(REPO, "train", f"run=now-{i}", "seed=1", "loss=ce"))
    one_before, one_now = min(befores), min(nows)
    stack_now = _timed([py, "-c", STACK_CODE, str(tmp), str(STACK)], REPO)
    ev_before = stage(before, "evaluate", "run=before-0", "stage_dir=train", *shifted)
    ev_now = stage(REPO, "evaluate", "run=now-0", "stage_dir=train", *shifted)
    rows = []
    base = 3600 / one_before
    for what, runs, seconds in (
        ("before: one run per process", 1, one_before),
        ("now: one run per process", 1, one_now),
        (f"now: a stack of {STACK} seeds in one process", STACK, stack_now),
    ):
        rows.append(_row(what, runs, seconds, runs * 3600 / seconds / base))
    for what, seconds in (("before: evaluate", ev_before), ("now: evaluate", ev_now)):
        rows.append(_row(what, 1, seconds, ev_before / seconds))
    notes = [
        f"Sitting: before = {before} (SEMIX_BEFORE), now = this checkout, in turn on one root; "
        "each command a fresh process with OMP_NUM_THREADS=1 (the preset's cpu_threads=1): "
        "wall time with its start, data decode, validation every epoch, checkpoints, outputs.",
        f"One run per process: the fastest of {REPEATS} in turn; all, before: "
        f"{_listed(befores)} s; now: {_listed(nows)} s.",
        "Precision: before computed fp32 (its auto on every CPU); now computed "
        f"{_computed(root / 'train' / 'now-0')} (host.json: what auto is on this CPU).",
        f"Evaluate: real/test + real/val, the shift stage's corruptions x 5 severities of "
        f"{SHIFT_IMAGES} test images (the study's) and two OOD sets (digits, uniform), "
        "ts_criterion=nll.",
        f"Data: {'Debian' if idx.parts[1] == 'usr' else 'sklearn digits at 28x28 with noise'} "
        "(Fashion-MNIST's shapes and sizes: 54k/6k/10k, 28x28 grey, 10 classes).",
    ]
    return rows, notes


def _computed(run_dir: Path) -> str:
    return read_json(run_dir / "host.json").get("precision", "fp32")


def _listed(seconds: list[float]) -> str:
    return ", ".join(f"{t:.1f}" for t in seconds)


def _row(what: str, runs: int, seconds: float, ratio: float) -> dict:
    return {
        "what (one thread)": what,
        "wall s": f"{seconds:.1f}",
        "s per run": f"{seconds / runs:.1f}",
        "per core-hour": f"{runs * 3600 / seconds:.0f}",
        "x before": f"{ratio:.2f}",
    }


def run() -> dict:
    train, evals, notes = roofline()
    before = os.environ.get("SEMIX_BEFORE")
    if not before:
        notes.append("Sitting skipped: set SEMIX_BEFORE to a checkout to compare against.")
        return {"title": TITLE, "rows": train, "tables": {LOGITS: evals}, "notes": notes}
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-train-"))
    try:
        rows, more = sitting(Path(before).resolve(), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tables = {"Roofline of the training step (one thread)": train, LOGITS: evals}
    return {"title": TITLE, "rows": rows, "tables": tables, "notes": notes + more}


TITLE = "Study classifier: roofline and runs per core-hour"
LOGITS = "Evaluation logits (one thread)"
