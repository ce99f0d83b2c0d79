"""annotate-stage throughput vs the bare encoder forward on the same images, and its scaling.

"The same images" are the series images as the stage finds them: PNG bytes in shards. Two bare
loops bracket the stage: `forward` encodes already-decoded uint8 tensors (the encoder's ceiling,
no I/O at all), `decode + forward` first decodes the PNG bytes (held in memory), which anything
that reads the series must do. The stage adds reading and checking the shards, λ̂, writing the
mixed shards (tar, sha256, fsync) and the report.

Each encoder runs the stage on S and 10·S series with the prototypes already in place, so only
series images are encoded. `stage` rows are whole runs (start-up, report and plot included);
the `marginal` row is (t(10·S) − t(S)) / (9·S images): the per-image cost once fixed costs are
paid, the number that decides large runs. Encoders: the digits classifier (digits-cnn, ~2.6
MFLOPs/image: the cheapest semix uses, so the stage's own overhead weighs most) and OpenCLIP
ViT-S-32 with random weights (a small CLIP; speed does not depend on the weights).

One intra-op thread and `workers=0` throughout: bare loop and stage get the same single core, so
the ratio is the stage's overhead and nothing else (the dev machine is 2 cores shared by several
people; two OpenMP threads there stall whenever someone else holds a core). One extra row shows
`workers=1` (decoding in a second process) for what a spare core buys.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from core.logs import setup_logging
from models.classifiers import build_classifier
from models.encoders import ImageEncoder, ModuleFeatureEncoder, OpenCLIPEncoder
from pipeline.registry import run_stage
from shards.manifest import manifest_digest
from shards.reader import decode_png, load_split
from shards.runs import save_weights
from shards.writer import ShardFolder, encode_png

K, SERIES_PER_SHARD = 8, 32  # 256 images per shard
MEAN, STD = [0.2, 0.2, 0.2], [0.3, 0.3, 0.3]
KEEP = ("prototypes.safetensors", "prototypes.json")
# encoder -> (series S, batch size, repeats)
PLAN = {"digits-cnn": (250, 256, 3), "OpenCLIP ViT-S-32": (8, 64, 1)}


def _root(out: Path, name: str, real: Path, n_series: int) -> str:
    """out/name/ with real/ and n_series pixel blends of real digits (K images each)."""
    root = out / name
    shutil.copytree(real, root / "real")
    train = load_split(root / "real" / "train")
    g = torch.Generator().manual_seed(0)
    folder = ShardFolder(root / "series", prefix="series")
    alphas = [k / (K - 1) for k in range(K)]
    n_shards = -(-n_series // SERIES_PER_SHARD)
    for shard in range(n_shards):
        samples = []
        for sid in range(shard * SERIES_PER_SHARD, min(n_series, (shard + 1) * SERIES_PER_SHARD)):
            a, b = torch.randperm(10, generator=g)[:2].tolist()
            i_a, i_b = torch.randint(0, len(train), (2,), generator=g).tolist()
            for k, alpha in enumerate(alphas):
                x = alpha * train.images[i_a].float() + (1 - alpha) * train.images[i_b].float()
                meta = {"series": sid, "position": k, "classes": [a, b], "alpha": alpha}
                samples.append(
                    {
                        "__key__": f"s{sid:07d}_{k:02d}",
                        "png": x.round().to(torch.uint8).numpy(),
                        "cls": a if alpha >= 0.5 else b,
                        "json": {**meta, "names": [str(a), str(b)], "seed": sid},
                    }
                )
        folder.write(shard, samples)
    folder.finish(
        n_shards,
        kind="series",
        class_names=train.class_names,
        upstream={"real": manifest_digest(root / "real" / "train")},
        info={"alphas": alphas, "num_series": n_series},
    )
    return name


def _stage(out: Path, name: str, sets: list[str]) -> float:
    """Seconds of one annotate run, mixed/ emptied first except the prototypes."""
    mixed = out / name / "mixed"
    if mixed.is_dir():
        for p in mixed.iterdir():
            if p.name not in KEEP:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    t0 = time.perf_counter()
    run_stage("annotate", "digits", [f"out={out}", f"name={name}", *sets])
    return time.perf_counter() - t0


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(
    label: str, encoder: ImageEncoder, out: Path, real: Path, sets: list[str]
) -> tuple[list[dict], float]:
    n_series, batch, repeats = PLAN[label]
    small = _root(out, f"{label}-small".replace(" ", "_"), real, n_series)
    large = _root(out, f"{label}-large".replace(" ", "_"), real, 10 * n_series)
    n_small, n_large = n_series * K, 10 * n_series * K
    sets = [*sets, f"batch_size={batch}", "device=cpu"]
    images = load_split(out / large / "series").images
    pngs = [encode_png(im) for im in images.numpy()]
    encoder.batch_size = batch
    encoder.encode(images[:batch])  # warm-up

    def decode_forward():
        return encoder.encode(torch.from_numpy(np.stack([decode_png(p) for p in pngs])))

    _stage(out, small, sets)  # computes the prototypes; the large run reuses a copy
    (out / large / "mixed").mkdir(parents=True)
    for name in KEEP:
        shutil.copy(out / small / "mixed" / name, out / large / "mixed" / name)
    best = {"fwd": [], "dec": [], "small": [], "large": []}
    for _ in range(repeats):  # interleaved, so that load from elsewhere hits all alike
        best["fwd"].append(_timed(lambda: encoder.encode(images)))
        best["dec"].append(_timed(decode_forward))
        best["small"].append(_stage(out, small, sets))
        best["large"].append(_stage(out, large, sets))
    t = {k: min(v) for k, v in best.items()}
    per_fwd, per_dec = t["fwd"] / n_large, t["dec"] / n_large
    marginal = (t["large"] - t["small"]) / (n_large - n_small)

    def row(what: str, n: int, per_image: float, ratio: bool = True) -> dict:
        return {
            "encoder": label,
            "run": what,
            "images": f"{n:,}",
            "seconds": f"{per_image * n:.2f}",
            "img/s": f"{1 / per_image:,.0f}",
            "vs forward": f"{per_fwd / per_image:.2f}" if ratio else "",
            "vs decode + forward": f"{per_dec / per_image:.2f}" if ratio else "",
        }

    rows = [
        row("bare forward (uint8 in memory)", n_large, per_fwd, False),
        row("bare decode + forward (PNG bytes)", n_large, per_dec, False),
        row(f"stage, {n_series} series", n_small, t["small"] / n_small),
        row(f"stage, {10 * n_series} series", n_large, t["large"] / n_large),
        row("stage, marginal per image", n_large - n_small, marginal),
    ]
    if repeats > 1:  # what a second core buys: decoding in a worker process
        t_workers = min(_stage(out, large, [*sets, "workers=1"]) for _ in range(repeats))
        rows.append(row(f"stage, {10 * n_series} series, workers=1", n_large, t_workers / n_large))
    return rows, t["large"] / t["small"]


def gpu_encoder_row(model: str = "ViT-L-14", n: int = 4096, device: str = "cuda") -> dict:
    """Encoder throughput at CIFAR size (32x32 uint8 in, upsampled to 224 by the encoder), bf16."""
    encoder = OpenCLIPEncoder(model, None, device=device, precision="bf16", batch_size=256)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8)
    encoder.encode(images[:256])  # warm-up: kernels, allocator
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    encoder.encode(images)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {
        "encoder": f"OpenCLIP {model} (random weights, bf16, {device})",
        "run": "bare encode, 32x32 -> 224",
        "images": f"{n:,}",
        "seconds": f"{seconds:.2f}",
        "img/s": f"{n / seconds:,.0f}",
        "vs forward": "",
        "vs decode + forward": "",
    }


def run() -> dict:
    setup_logging(is_main=False)
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-annotate-"))
    rows, notes = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        real = run_stage("prepare", "digits", [f"out={tmp}"])
        out = tmp / "runs"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            cnn = build_classifier("digits-cnn", 10)
            import open_clip

            clip = open_clip.create_model("ViT-S-32", pretrained=None)
        meta = {
            "arch": cnn.arch_config(),
            "class_names": list("0123456789"),
            "image_size": 16,
            "normalize": {"mean": MEAN, "std": STD},
        }
        for name in ("digits-cnn-small", "digits-cnn-large"):
            save_weights(out / name / "train" / "encoder", cnn.state_dict(), meta)
        encoder = ModuleFeatureEncoder(cnn, 16, MEAN, STD, {}, device="cpu")
        cnn_rows, scale = _measure("digits-cnn", encoder, out, real, ["workers=0"])
        rows += cnn_rows
        notes.append(f"digits-cnn scaling: t(10·S) / t(S) = {scale:.2f} (goal <= 11).")

        from safetensors.torch import save_file

        ckpt = tmp / "vit-s-32-random.safetensors"
        save_file(clip.state_dict(), str(ckpt))
        del clip
        encoder = OpenCLIPEncoder("ViT-S-32", str(ckpt), device="cpu")
        sets = ["workers=0", "encoder=openclip", "encoder.openclip.model=ViT-S-32"]
        sets += [f"encoder.openclip.pretrained={ckpt}", "prototypes=text"]
        clip_rows, scale = _measure("OpenCLIP ViT-S-32", encoder, out, real, sets)
        rows += clip_rows
        notes.append(f"OpenCLIP ViT-S-32 scaling: t(10·S) / t(S) = {scale:.2f} (goal <= 11).")
        # ---------------- GPU section: runs only when CUDA is available -----------------
        if torch.cuda.is_available():
            rows.append(gpu_encoder_row())
        else:
            notes.append(
                "GPU row (OpenCLIP ViT-L-14, random weights, bf16) skipped: no CUDA device."
            )
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    notes += [
        "16x16 digit blends, K = 8, 256 images per shard, fp32, one thread, one process; "
        "best of 3 (digits-cnn) / 1 (ViT-S-32), stage and bare runs interleaved.",
        "`vs ...` = stage throughput / bare throughput (goal >= 0.9). OpenCLIP runs use text "
        "prototypes (no real images encoded) and hash their checkpoint file at start-up.",
    ]
    return {"title": "annotate stage vs bare encoder", "rows": rows, "notes": notes}
