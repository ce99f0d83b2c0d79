"""The guided sampler's levers on a fitted in-house generator, on noise the fit never used.

    python -m bench levers                                        # runs/fashion-mnist
    SEMIX_BENCH_LEVERS=runs/fashion-mnist python -m bench levers  # that run root

Why: at the chosen guidance (w = 1.5) the 25-step DDIM draws the class more often than the
50-step one (bench/RESULTS.md, "sampler and steps vs endpoint fidelity"), while at w = 1 the
step count does not matter. A sampler that converges to its ODE should not get worse with more
steps. The suspect is diffusers' DDIM with `clip_sample`: each step clamps the predicted clean
image x̂_0 to [-1, 1] but keeps the ε it derived from the unclamped x̂_0, so each step moves x_t
by sqrt(ᾱ_prev)·(clamp(x̂_0) − x̂_0). Guidance extrapolates x̂_0 past the range far more often than
w = 1 does, and N steps inject that N times. Each row is one lever at a time, with the same
fresh seeded noise (seed + 1 of the fit's, so nothing here chose w): DDIM 25 / 50 / 100 with
clipping on (the training scheduler's config, as generate samples today) and off, guidance
rescale φ = 0.7 (Lin et al., 2024; diffusers' rescale_noise_cfg), and DPM-Solver++ 25.

Columns: every judge (the chooser first: the annotation encoder's 5k-label CNN; the linear
probe; the 54k report judges), the share of x̂_0 pixels clipped over the whole run (clip on),
and the background (the mean of the four 4x4 corners, 0-255; real test: bench judges).
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from bench import FITTED, fitted_generator, run_root
from bench.bench_judges import corners
from models.generators import load_generator, make_scheduler
from shards.datasets import load_real
from stages.common.fidelity import endpoint_fidelity

# (sampler, steps, clip_sample, guidance_rescale)
LEVERS = (
    ("ddim", 25, True, 0.0), ("ddim", 50, True, 0.0), ("ddim", 100, True, 0.0),
    ("ddim", 25, False, 0.0), ("ddim", 50, False, 0.0), ("ddim", 100, False, 0.0),
    ("ddim", 25, True, 0.7), ("ddim", 50, True, 0.7),
    ("dpmsolver++", 25, True, 0.0),
)  # fmt: skip


def seen(predict, into: list):
    """`predict` that also keeps the images it was shown."""

    def wrapped(images: torch.Tensor) -> torch.Tensor:
        into.append(images)
        return predict(images)

    return wrapped


class ClipCounter:
    """Counts how many x̂_0 pixels the DDIM step clamps, by wrapping the scheduler's step."""

    def __init__(self, scheduler) -> None:
        self.clipped = self.total = 0
        inner = scheduler.step

        def step(model_output, timestep, sample, **kwargs):
            a = scheduler.alphas_cumprod[int(timestep)].to(sample.dtype)
            if scheduler.config.prediction_type == "v_prediction":
                x0 = a.sqrt() * sample - (1 - a).sqrt() * model_output
            else:
                x0 = (sample - (1 - a).sqrt() * model_output) / a.sqrt()
            self.clipped += int((x0.abs() > 1).sum())
            self.total += x0.numel()
            return inner(model_output, timestep, sample, **kwargs)

        scheduler.step = step


def run() -> dict | None:
    root = run_root(
        "levers", "SEMIX_BENCH_LEVERS", ("runs/fashion-mnist",), FITTED, "fitted generator"
    )
    if root is None:
        return None
    config, fidelity, judges = fitted_generator(root)
    chosen = float(fidelity["guidance"])
    names = load_real(root / "real" / "test").class_names
    per_class = config.fidelity.per_class
    seed = config.seed + 1  # fresh noise: the fit's check used seed
    sched_config = json.loads(
        (root / "generator" / "scheduler" / "scheduler_config.json").read_text()
    )
    rows = []
    for sampler, steps, clip, rescale in LEVERS:
        gen = load_generator(
            "unet", model=str(root / "generator"), sampler=sampler, steps=steps,
            guidance=chosen, batch_size=per_class * len(names),
        )  # fmt: skip
        gen.scheduler = make_scheduler(sampler, {**sched_config, "clip_sample": clip})
        gen.guidance_rescale = rescale
        counter = ClipCounter(gen.scheduler) if sampler == "ddim" else None
        captured: list[torch.Tensor] = []  # the images, for the background column
        judged = [dataclasses.replace(judges[0], predict=seen(judges[0].predict, captured))]
        t0 = time.perf_counter()
        point = endpoint_fidelity(
            gen, [chosen], judged + judges[1:], names, seed=seed, per_class=per_class
        )
        took = time.perf_counter() - t0
        point = point[f"{chosen:g}"]
        first = judges[0].name
        worst = min(point[first]["per_class"].items(), key=lambda kv: kv[1]["accuracy"])
        rows.append({
            "sampler": sampler, "steps": steps, "clip x̂0": "on" if clip else "off",
            "rescale φ": f"{rescale:g}",
            **{f"{j} %": f"{st['accuracy']:.1f}" for j, st in point.items()},
            f"worst ({first})": f"{worst[0]} {worst[1]['accuracy']:.0f} %",
            "x̂0 px clipped": f"{100 * counter.clipped / counter.total:.1f} %" if counter else "-",
            "background": f"{float(corners(captured[0]).mean()):.1f}",
            "ms / image": f"{1000 * took / (per_class * len(names)):.0f}",
        })  # fmt: skip
    notes = [
        f"{root}/generator ({config.unet}, {config.noise.prediction_type}, "
        f"{config.train_steps} fit steps), w = {chosen:g} (chosen by {judges[0].name}), "
        f"{per_class} images per class ({per_class * len(names)} per row) from seed {seed} "
        f"(the fit's check: seed {seed - 1}), float32, {torch.get_num_threads()} threads.",
        "judges' accuracy on real test: "
        + ", ".join(f"{j.name} {j.real_test_accuracy:.1f} %" for j in judges),
    ]
    return {"title": f"generate: the guided sampler's levers ({root.name})", "rows": rows,
            "notes": notes}  # fmt: skip
