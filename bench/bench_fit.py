"""fit-generator's training step: fp32 vs bf16 autocast, side by side in one process.

    python -m bench fit                     # step times of the digits and fashion UNets
    SEMIX_BENCH_FIT=runs/digits/generator python -m bench fit   # + that fit's fidelity curve

The step is the stage's own: a batch of 128 real-sized images, the DDPM forward process, the
UNet under accelerate's autocast, Min-SNR loss, backward, AdamW. fp32 and bf16 blocks alternate
(drift of a shared machine hits both), each the median of its blocks. With SEMIX_BENCH_FIT set,
the fidelity curve of that fitted generator folder is tabulated against the minutes its steps
took (fidelity.json's points; minutes = step x the measured step time of its precision, so the
checks themselves are not counted).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench import fit_config
from core.accelerator import new_accelerator
from models.generators import UNET_PRESETS, unet_from_preset
from models.generators.objective import denoising_loss
from stages.common.loop import accelerate_precision

BATCH, BLOCK, BLOCKS, WARMUP = 128, 5, 4, 3


def _step_time(unet_name: str, precision: str) -> list[float]:
    accelerator = new_accelerator(cpu=True, mixed_precision=precision)
    torch.manual_seed(0)
    unet = unet_from_preset(unet_name, 10, null_class=True)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(unet, opt)
    size = UNET_PRESETS[unet_name].image_size
    x0 = torch.rand(BATCH, 3, size, size) * 2 - 1
    y = torch.randint(0, 11, (BATCH,))
    snr = torch.linspace(0.01, 100.0, 1000)

    def step() -> None:
        t = torch.randint(0, 1000, (BATCH,))
        eps = torch.randn_like(x0)
        x_t = 0.7 * x0 + 0.7 * eps
        with accelerator.autocast():
            pred = model(x_t, t, class_labels=y).sample
        loss = denoising_loss(pred.float(), eps, snr[t], 5.0)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(BLOCK):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run() -> dict:
    rows, notes = [], []
    native = accelerate_precision("auto", cpu=True)
    for unet_name in ("digits-tiny", "fashion-28"):
        times: dict[str, list[float]] = {"no": [], "bf16": []}
        for _ in range(BLOCKS):
            for precision in times:
                times[precision] += _step_time(unet_name, precision)
        fp32, bf16 = statistics.median(times["no"]), statistics.median(times["bf16"])
        rows.append(
            {
                "UNet": unet_name,
                "threads": torch.get_num_threads(),
                "fp32 s/step": f"{fp32:.3f}",
                "bf16 s/step": f"{bf16:.3f}",
                "speed-up": f"{fp32 / bf16:.2f}x",
            }
        )
    notes.append(
        f"batch {BATCH}, {BLOCKS} alternating blocks of {BLOCK} timed steps per precision after "
        f"{WARMUP} warm-up steps, medians; precision=auto picks {native!r} on this CPU "
        "(bf16 where it has AVX512-BF16 or AMX)."
    )
    folder = os.environ.get("SEMIX_BENCH_FIT")
    if folder:
        notes += fidelity_per_minute(Path(folder), rows)
    return {"title": "fit-generator: fp32 vs bf16 step, fidelity per minute", "rows": rows,
            "notes": notes}  # fmt: skip


def fidelity_per_minute(folder: Path, rows: list[dict]) -> list[str]:
    """One note line per fidelity point of a fitted folder: minutes of training, fidelity at
    the chosen w by every judge."""
    fidelity = json.loads((folder / "fidelity.json").read_text())
    config = fit_config(folder)
    row = next(r for r in rows if r["UNet"] == config.unet)
    precision = accelerate_precision(config.precision, cpu=True)
    per_step = float(row["bf16 s/step" if precision == "bf16" else "fp32 s/step"])
    w = f"{fidelity['guidance']:g}"
    out = [
        f"fidelity per minute of {folder} ({config.unet}, {config.train_steps} steps, "
        f"{precision}, chosen w = {w}; minutes = step x {per_step:.3f} s):"
    ]
    for point in fidelity["curve"]:
        judged = ", ".join(f"{j} {s['accuracy']:.1f} %" for j, s in point["guidance"][w].items())
        out.append(f"step {point['step']} ({point['step'] * per_step / 60:.1f} min): {judged}")
    return out
