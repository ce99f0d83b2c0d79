"""edm backend at the paper's scale: the CIFAR-100 plan with the EDM-size network (GPU only).

The CIFAR-100 "cond-vp" DDPM++ architecture of EDM (55.7 M parameters, 32x32, label_dim 100,
augment_dim 9) with random weights (speed does not depend on them), Heun 25 steps = 49 network
calls per image, bf16, through the generate stage (`--preset cifar100 --set backend=edm`):
images/s on the first N series of the plan after a warm-up, and the time this gives for the whole
158,400-image set (4950 pairs x 4 series x 8 alphas) on one GPU.

Without CUDA this benchmark is skipped (one note, no rows): on 2 CPU cores one EDM-size network
call on 2 images takes ~1 s, i.e. ~days for the set.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_generate import _real
from models.generators import EDMNetwork
from pipeline.registry import run_stage

SERIES, K, FULL_IMAGES = 64, 8, 158_400
BATCH_SIZES = (256, 512)


def edm_cifar100() -> EDMNetwork:
    """EDM train.py --cond=1 --arch=ddpmpp --precond=vp for CIFAR-100, random weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return EDMNetwork(img_resolution=32, label_dim=100, architecture="ddpmpp", precond="vp",
                          model_channels=128, channel_mult=[2, 2, 2], augment_dim=9)  # fmt: skip


def run() -> dict:
    title = "edm backend: CIFAR-100 plan, EDM-size network"
    if not torch.cuda.is_available():
        return {"title": title, "rows": [], "notes": ["skipped: no CUDA device here"]}
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-edm-"))
    rows = []
    try:
        model = tmp / "edm-cifar100-random"
        net = edm_cifar100()
        net.save_pretrained(model)
        params = sum(p.numel() for p in net.parameters())
        for batch in BATCH_SIZES:
            for compile_ in (False, True):
                sets = ["backend=edm", f"model={model}", f"batch_size={batch}",
                        f"torch_compile={compile_}", "shards.series_per_shard=32"]  # fmt: skip
                for tag, limit in (("warm", 32), ("timed", SERIES)):  # warm-up: kernels, compile
                    out = tmp / f"{tag}-{batch}-{compile_}"
                    _real(out / "cifar100", 100, 32)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run_stage(
                        "generate", "cifar100", [*sets, f"out={out}", f"mixing.limit={limit}"]
                    )
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                    shutil.rmtree(out, ignore_errors=True)
                ips = SERIES * K / seconds
                rows.append({
                    "GPU": torch.cuda.get_device_name(0), "params": f"{params / 1e6:.1f} M",
                    "batch": batch, "compile": compile_, "images": SERIES * K,
                    "img/s (stage)": f"{ips:.1f}",
                    "158,400 images (h)": f"{FULL_IMAGES / ips / 3600:.2f}",
                })  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notes = ["Heun 25 steps (49 network calls per image), bf16, one process; the stage time "
             "includes PNG/tar/sha256, preview and manifest."]  # fmt: skip
    return {"title": title, "rows": rows, "notes": notes}
