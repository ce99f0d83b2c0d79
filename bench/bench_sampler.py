"""generate's sampler and step count vs endpoint fidelity, for a fitted in-house generator.

    python -m bench sampler                                      # runs/fashion-mnist, else runs/digits
    SEMIX_BENCH_SAMPLER=/work/runs-verdict/fashion-mnist python -m bench sampler  # a study's fit
    SEMIX_BENCH_SAMPLER=runs/fashion-mnist python -m bench sampler   # that run root

fit-generator chooses the guidance w on its fidelity check at one sampler and step count (the
preset's). This asks whether another sampler or step count would do better: the same check
(stages.common.fidelity.endpoint_fidelity: per_class pure-class images per class from the fit's seeded
noise, judged by the fit's CNN judge and the linear probe) at each (sampler, steps, w), with the
seconds each image took; and, as a note, how far the clean image the UNet implies is from the
truth at each noise level (on val images). The 25-step DDIM row at the chosen w repeats the
fit's last curve point (up to the fit's autocast: this runs in float32).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench import FITTED, fit_config, run_root
from models.generators import load_generator, load_unet
from models.generators.objective import predicted_x0
from shards.datasets import load_real
from stages.common.fidelity import endpoint_fidelity, make_judges

# ddim 100: worse still; the multistep solvers at 10-15 steps are the study's speed cells
# (pipeline/study/cells.py, fit-generator fidelity.samplers): fidelity and ms / image of each
GRID = (
    ("ddim", 10), ("ddim", 25), ("ddim", 50), ("dpmsolver++", 25), ("dpmsolver++", 12),
    ("dpmsolver++", 10), ("unipc", 15), ("unipc", 12), ("unipc", 10),
)  # fmt: skip
NOISE_LEVELS = (10, 100, 300, 500, 700, 900, 999)


@torch.no_grad()
def x0_error_by_t(root: Path, n: int = 512) -> str:
    """Mean squared error of x̂_0, the clean image the UNet's prediction implies, on the first
    n real/val images (never trained on) with their own labels, at each noise level t. A model
    that knew only the class mean at t ≈ T would score about the data's variance (~0.5): far
    above it, the sampler lives on clip_sample."""
    from diffusers import DDPMScheduler

    unet, scheduler_config = load_unet(root / "generator")
    unet.eval()
    alphas_cumprod = DDPMScheduler.from_config(scheduler_config).alphas_cumprod
    prediction_type = scheduler_config.get("prediction_type", "epsilon")
    val = load_real(root / "real" / "val")
    x0 = val.images[:n].permute(0, 3, 1, 2).float() / 127.5 - 1
    g = torch.Generator().manual_seed(0)
    cells = []
    for t in NOISE_LEVELS:
        a = alphas_cumprod[t]
        eps = torch.randn(x0.shape, generator=g)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
        pred = unet(x_t, torch.full((len(x0),), t), class_labels=val.labels[:n].long()).sample
        x0_hat = predicted_x0(x_t, pred, a, prediction_type)
        cells.append(f"t={t}: {float((x0_hat - x0).pow(2).mean()):.3g}")
    return (
        f"x̂_0 error (MSE, [-1, 1] pixels) on {len(x0)} real/val images, data variance "
        f"{float(x0.var()):.2f}: " + ", ".join(cells)
    )


def run() -> dict | None:
    root = run_root(
        "sampler",
        "SEMIX_BENCH_SAMPLER",
        ("runs/fashion-mnist", "runs/digits"),
        FITTED,
        "fitted generator",
    )
    if root is None:
        return None
    config = fit_config(root / "generator")
    chosen = float(json.loads((root / "generator" / "fidelity.json").read_text())["guidance"])
    judges = make_judges(root, config.fidelity.judge, "cpu")
    names = load_real(root / "real" / "test").class_names
    per_class = config.fidelity.per_class
    guidance = sorted({1.0, chosen})
    rows = []
    for sampler, steps in GRID:
        gen = load_generator(
            "unet", model=str(root / "generator"), sampler=sampler, steps=steps,
            guidance=chosen, batch_size=per_class * len(names),
        )  # fmt: skip
        for w in guidance:
            t0 = time.perf_counter()
            point = endpoint_fidelity(
                gen, [w], judges, names, seed=config.seed, per_class=per_class
            )[f"{w:g}"]
            took = time.perf_counter() - t0
            cnn = point[judges[0].name]
            worst = min(cnn["per_class"].items(), key=lambda kv: kv[1]["accuracy"])
            rows.append({
                "sampler": sampler, "steps": steps, "w": f"{w:g}",
                **{f"{j} %": f"{st['accuracy']:.1f}" for j, st in point.items()},
                f"worst class ({judges[0].name})": f"{worst[0]} {worst[1]['accuracy']:.0f} %",
                "ms / image": f"{1000 * took / (per_class * len(names)):.0f}",
            })  # fmt: skip
    notes = [
        f"{root}/generator ({config.unet}, {config.train_steps} fit steps, chosen w = {chosen:g} "
        f"at the preset's {config.preview.sample_steps}-step DDIM), {per_class} images per class "
        f"({per_class * len(names)} per cell), float32, {torch.get_num_threads()} threads.",
        "judges' accuracy on real test: "
        + ", ".join(f"{j.name} {j.real_test_accuracy:.1f} %" for j in judges),
        x0_error_by_t(root),
    ]
    what = f"{root.name}, {config.noise.prediction_type}"
    return {"title": f"generate: sampler and steps vs endpoint fidelity ({what})", "rows": rows,
            "notes": notes}  # fmt: skip
