"""Expected cost of an ImageNet CSM set (docs/scale.md, same title): FLOPs counted, CPU rates
and bytes measured here, GPU-hours from stated assumptions. No GPU and no weights are needed:

- FLOPs per image: torch's FlopCounterMode over the real architectures built from their configs
  on the meta device (shapes only), called as the stages call them;
- work (pairs, images, shards, steps, epochs): the `imagenet` presets through the stages' own
  configs and generate plan (`imagenet_work`);
- bytes and PNG rates: crops of the photos that ship with scikit-learn and matplotlib, made
  256 px by prepare's centre crop, written by the shard writer;
- GPU-hours = FLOPs / (H100 dense bf16 peak x MFU), MFU from the assumed ranges of `MFU`.

    python -m bench cost
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import RESULTS
from bench.bench_generate import PEAK_BF16
from pipeline.registry import resolve_stage_config
from stages.generate import make_plan

PEAK = PEAK_BF16["H100"]  # H100 SXM dense bf16 (no sparsity), FLOP/s
IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000  # ILSVRC-2012; its val set is our test split
CSM_MEMBERS = 2  # synthetic images per real image per step (models.training.sample_csm_members)
# facebook/DiT-XL-2-256: transformer/config.json and vae/config.json (sd-vae-ft-ema)
DIT_XL2 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
               num_layers=28, sample_size=32, patch_size=2, num_embeds_ada_norm=1000)  # fmt: skip
SD_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
              down_block_types=("DownEncoderBlock2D",) * 4, norm_num_groups=32,
              up_block_types=("UpDecoderBlock2D",) * 4, sample_size=256,
              scaling_factor=0.18215)  # fmt: skip
# Assumed model FLOP utilisation on an H100 (low, high); semix has measured none (issue 16). Why
# these: docs/scale.md, "Expected cost of an ImageNet CSM set".
MFU = {"dit": (0.30, 0.50), "vae": (0.20, 0.40), "clip": (0.20, 0.40), "resnet": (0.10, 0.20)}


# ------------------------------------------------------------------------- FLOPs


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs FlopCounterMode counts while `fn` runs: matmuls, convolutions and attention, 2 per
    multiply-add, backward included. Elementwise ops and norms are not counted (memory-bound:
    they lower the MFU rather than add FLOPs). Count on the meta device: there attention
    decomposes into counted bmm, while torch's CPU attention kernel is left uncounted."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def dit_xl2(device: str = "meta") -> torch.nn.Module:
    """DiT-XL/2-256 with the backend's mixable class tables (models.generators.dit)."""
    from diffusers import DiTTransformer2DModel

    from models.generators.base import make_mixable

    with torch.device(device):
        net = DiTTransformer2DModel(**DIT_XL2).eval()
    for block in net.transformer_blocks:
        make_mixable(block.norm1.emb.class_embedder, "embedding_table")
    return net


def dit_flops(transformer, vae, *, steps: int, guidance: float, batch: int) -> dict[str, float]:
    """FLOPs per image of `DiTGenerator.sample`: per step one transformer forward over the batch,
    twice the rows when guidance > 1 (the null class, as DiTPipeline), conditioned on class-weight
    vectors [rows, table]; then one VAE decode. DDIM's update is elementwise (not counted)."""
    rows = batch * (2 if guidance > 1 else 1)
    cfg, p = transformer.config, next(transformer.parameters())
    x = torch.zeros(rows, cfg.in_channels, cfg.sample_size, cfg.sample_size, device=p.device)
    table = transformer.transformer_blocks[0].norm1.emb.class_embedder.embedding_table
    cond = torch.zeros(rows, table.num_embeddings, device=p.device)
    t = torch.full((rows,), 500, device=p.device)
    with torch.no_grad():
        step = count_flops(lambda: transformer(x, timestep=t, class_labels=cond))
        decode = count_flops(lambda: vae.decode(x[:batch]))
    return {"denoiser": steps * step / batch, "decode": decode / batch}


def encoder_flops(model_name: str) -> tuple[float, int]:
    """(FLOPs per image, input side) of annotate's OpenCLIP image tower (its encoder resizes every
    image to the tower's input size first)."""
    from models.encoders import ENCODERS

    encoder = ENCODERS["openclip"](model_name, None, device="cpu")  # random weights
    encoder.model.to("meta")
    x = torch.zeros(1, 3, *encoder.image_size, device="meta")
    with torch.no_grad():
        return count_flops(lambda: encoder.model.encode_image(x, normalize=False)), x.shape[-1]


def classifier_flops(model: str, size: int, classes: int) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs per image of a train-mode classifier at `size` px."""
    from models.classifiers import build_classifier

    with torch.device("meta"):
        net = build_classifier(model, classes).train()
    x = torch.zeros(2, 3, size, size, device="meta")
    fwd = count_flops(lambda: net(x))
    both = count_flops(lambda: net(x).float().sum().backward())
    return fwd / 2, both / 2


# ------------------------------------------------------------------------- work


def imagenet_work(sets: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """What the `imagenet` presets do (stage -> `--set` overrides), read from their configs and
    the generate plan, not restated here."""
    sets = sets or {}
    cfg = {s: resolve_stage_config(s, "imagenet", list(sets.get(s, ()))) for s in
           ("prepare", "generate", "annotate", "train")}  # fmt: skip
    gen, prep, ann, train = cfg["generate"], cfg["prepare"], cfg["annotate"], cfg["train"]
    classes = len(gen.backend.dit.class_ids)  # one ImageNet id per class
    plan = make_plan(gen, classes)
    images = plan.num_series * len(plan.alphas)
    val = round(IMAGENET_TRAIN * prep.val_fraction)  # about: prepare rounds class by class
    real_train = IMAGENET_TRAIN - val
    return {
        "configs": cfg, "plan": plan, "classes": classes, "pairs": len(plan.pairs),
        "series": plan.num_series, "members": len(plan.alphas), "images": images,
        "shards": plan.num_shards, "steps": gen.sample_steps, "guidance": gen.guidance,
        "batch": gen.batch_size, "size": prep.image_size, "real_train": real_train,
        "real_val": val, "real_test": IMAGENET_VAL,
        "encoded": images + (real_train if ann.prototypes == "real" else 0),
        "epochs": train.epochs, "trained_ce": train.epochs * real_train,
        "trained_csm": train.epochs * real_train * (1 + CSM_MEMBERS),
        "validated": train.epochs * val,
    }  # fmt: skip


# ------------------------------------------------------------------------- bytes and CPU rates


def photo_crops(per_photo: int = 24, size: int = 256, seed: int = 0) -> list[np.ndarray]:
    """Crops of the sample photos of scikit-learn (china, flower) and matplotlib (grace_hopper):
    4:3 windows of at least size x 0.75·(4/3) px, made `size` px by prepare's centre crop, as
    prepare makes ImageNet's photos."""
    from matplotlib import cbook
    from PIL import Image
    from sklearn.datasets import load_sample_images

    from stages.prepare import RESIZERS

    photos = list(load_sample_images().images)
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        photos.append(np.asarray(im.convert("RGB")))
    rng, out, low = np.random.default_rng(seed), [], math.ceil(size * 4 / 3)
    for photo in photos:
        h, w = photo.shape[:2]
        for _ in range(per_photo):
            cw = int(rng.integers(low, min(w, h * 4 // 3) + 1))
            ch = cw * 3 // 4
            y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            window = np.ascontiguousarray(photo[y : y + ch, x : x + cw])
            out.append(RESIZERS["center-crop"](window, size))
    return out


def png_rates(images: Sequence[np.ndarray]) -> dict[str, Any]:
    """PNG bytes and encode / decode img/s on one core (the shard writer's and reader's codecs)."""
    from shards.reader import decode_png
    from shards.writer import encode_png

    t0 = time.perf_counter()
    pngs = [encode_png(im) for im in images]
    enc = time.perf_counter() - t0
    dec = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for data in pngs:
            decode_png(data)
        dec = min(dec, time.perf_counter() - t0)
    sizes = [len(p) for p in pngs]
    return {"pngs": pngs, "sizes": sizes, "encode": len(pngs) / enc, "decode": len(pngs) / dec}


def shard_bytes(work: dict[str, Any], pngs: Sequence[bytes], tmp: Path) -> dict[str, dict]:
    """One shard of each kind at its real size, through the stages' own sample makers and the
    shard writer (tar + fsync + sha256 + offset index + record): bytes per image, write img/s."""
    from shards.writer import ShardFolder
    from stages.annotate.mixed import label, mixed_samples
    from stages.generate.series import shard_samples

    plan, gen = work["plan"], work["configs"]["generate"]
    specs = [plan.spec(s) for s in plan.shard_series(0)]
    ident = {"backend": gen.backend.name, "model_id": gen.model,
             "revision": gen.revision or None, "sampler": gen.sampler, "steps": gen.sample_steps,
             "guidance": gen.guidance}  # fmt: skip
    names = [f"n{c:08d}" for c in range(work["classes"])]  # wnid-long class names
    blank = torch.zeros(len(specs), work["members"], 1, 1, 3, dtype=torch.uint8)
    series = shard_samples(plan, specs, blank, names, ident)
    for i, s in enumerate(series):
        s["png"] = pngs[i % len(pngs)]  # photo PNG bytes, passed through by the writer
    # λ̂ by the ratio method (no encoder): float32 values, as long in json as real λ̂
    ann = resolve_stage_config("annotate", "imagenet", ["annotator=ratio"])
    meta = [s["json"] for s in series]
    mixed = mixed_samples(series, label(ann, meta, np.zeros((len(meta), 1)), None, None))
    n_real = work["configs"]["prepare"].shard_size
    real = [{"__key__": f"train_{i:07d}", "png": pngs[i % len(pngs)], "cls": i % work["classes"]}
            for i in range(n_real)]  # fmt: skip
    out = {}
    for kind, samples in (("series", series), ("mixed", mixed), ("real", real)):
        folder = ShardFolder(tmp / kind, prefix=kind)
        t0 = time.perf_counter()
        rec = folder.write(0, samples)
        took = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in (tmp / kind).rglob("*") if p.is_file())
        png = sum(len(s["png"]) for s in samples)
        out[kind] = {"per_image": size / rec.count, "img_s": rec.count / took,
                     "mb_s": rec.bytes / took / 1e6, "png_share": png / rec.bytes}  # fmt: skip
    return out


def annotation_json(work: dict[str, Any], pairs: int = 6000) -> float:
    """annotation.json bytes (canonical_json of annotation_stats, as annotate writes it) for
    `pairs` pairs: above models.annotation_stats.PER_PAIR_CAP the per-pair table gives way to its
    summary, so the size no longer grows with the number of pairs (the preset's 499,500 too)."""
    from core.io import canonical_json
    from models.annotation_stats import PER_PAIR_CAP, annotation_stats

    plan, k = work["plan"], work["members"]
    assert pairs > PER_PAIR_CAP, "measure where the preset's size behaves like the preset"
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([plan.pairs[i] for i in range(pairs)]).repeat_interleave(k, dim=0)
    alpha = torch.tensor(plan.alphas, dtype=torch.float64).repeat(pairs)
    lam = (alpha + 0.1 * torch.randn(pairs * k, generator=g, dtype=torch.float64)).clamp(0, 1)
    stats = annotation_stats(lam, alpha, torch.arange(pairs).repeat_interleave(k), table)
    return float(len(canonical_json(stats)))


def cpu_dit_forward() -> float:
    """Seconds of one DiT-XL/2 forward, batch 1, fp32, one thread: a sanity number."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        net, x = dit_xl2("cpu"), torch.randn(1, 4, 32, 32)
        kw = {"timestep": torch.tensor([500]), "class_labels": torch.eye(1001)[:1]}
        net(x, **kw)  # warm-up
        t0 = time.perf_counter()
        net(x, **kw)
        took = time.perf_counter() - t0
    torch.set_num_threads(threads)
    return took


# ------------------------------------------------------------------------- the table


def _stream_rows() -> str:
    """The 256 px rows of `python -m bench stream` (bench/RESULTS.md), reused, not re-measured."""
    lines = RESULTS.read_text().splitlines() if RESULTS.is_file() else []
    cells = [
        [c.strip() for c in s.strip("|").split("|")] for s in lines if s.startswith("| 256 px")
    ]
    return "; ".join(f"{c[1]}: {c[2]} img/s" for c in cells) or "not run (python -m bench stream)"


def _row(stage: str, work: str, flops: float, hours: tuple, mfu: str, core: float, tb: float):
    fmt = lambda v: f"{v:,.1f}" if v >= 1 else f"{v:.2f}"  # noqa: E731
    return {"stage": stage, "work": work, "FLOPs": f"{flops:.2e}" if flops else "-",
            "H100-hours": " - ".join(map(fmt, hours)) if flops else "-", "MFU assumed": mfu,
            "CPU core-hours (PNG)": f"{core:,.0f}" if core else "-",
            "storage": f"{tb:.2f} TB" if tb else "-"}  # fmt: skip


def cost_rows(w: dict, f: dict, per_image: dict, png: dict, ann_json: float) -> list[dict]:
    """One row per stage: work x per-image FLOPs -> H100-hours at the MFU range; PNGs encoded
    or decoded -> CPU core-hours at the measured one-core rates; bytes written -> TB."""
    n, real = w["images"], w["real_train"] + w["real_val"] + w["real_test"]
    val = w["validated"] * f["fwd"]
    # stage, work, FLOPs, MFU kind, PNGs encoded, PNGs decoded, bytes written
    specs = [
        ("prepare: real/", f"{real:,} photos to {w['size']} px PNG", 0, None, real, 0,
         real * per_image["real"]),
        ("generate: DiT-XL/2 denoiser", f"{n:,} images x {w['steps']} DDIM steps x 1 forward",
         n * f["denoiser"], "dit", 0, 0, 0),
        ("generate: VAE decode, series/", f"{n:,} decodes at {w['size']} px", n * f["decode"],
         "vae", n, 0, n * per_image["series"]),
        ("annotate: ViT-B-32, mixed/", f"{n:,} mixed + {w['real_train']:,} real at "
         f"{f['clip_size']} px", w["encoded"] * f["clip"], "clip", 0, w["encoded"],
         n * per_image["mixed"] + ann_json),
        ("train CSM: resnet50", f"{w['epochs']} epochs x {w['real_train']:,} x (1 real + "
         f"{CSM_MEMBERS} synthetic), fwd + bwd; val", w["trained_csm"] * f["both"] + val,
         "resnet", 0, w["trained_csm"] + w["validated"], 0),
        ("train CE (baseline, not in total)", f"{w['epochs']} epochs x {w['real_train']:,} "
         "real, fwd + bwd; val", w["trained_ce"] * f["both"] + val, "resnet", 0,
         w["trained_ce"] + w["validated"], 0),
    ]  # fmt: skip
    rows, total = [], np.zeros(5)
    for stage, work, flops, kind, n_enc, n_dec, stored in specs:
        hours = tuple(flops / (PEAK * m) / 3600 for m in reversed(MFU[kind])) if kind else (0, 0)
        core = (n_enc / png["encode"] + n_dec / png["decode"]) / 3600
        mfu = "{:.0%} - {:.0%}".format(*MFU[kind]) if kind else "-"
        rows.append(_row(stage, work, flops, hours, mfu, core, stored / 1e12))
        if "baseline" not in stage:
            total += (flops, *hours, core, stored / 1e12)
    rows.insert(-1, _row("total (CSM)", "", total[0], tuple(total[1:3]), "", *total[3:]))
    return rows


def run() -> dict:
    from diffusers import AutoencoderKL

    from bench.bench_stream import smooth_images
    from shards.writer import encode_png

    w = imagenet_work()
    cfg, n, steps = w["configs"], w["images"], w["steps"]
    with torch.device("meta"):
        vae = AutoencoderKL(**SD_VAE).eval()
    f = dit_flops(dit_xl2(), vae, steps=steps, guidance=w["guidance"], batch=w["batch"])
    clip = cfg["annotate"].encoder.params()["model"]  # the preset's CLIP encoder
    f["clip"], f["clip_size"] = encoder_flops(clip)
    f["fwd"], f["both"] = classifier_flops(cfg["train"].model, w["size"], w["classes"])
    png = png_rates(photo_crops(size=w["size"]))
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-cost-"))
    try:
        shards = shard_bytes(w, png["pngs"], tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ann = annotation_json(w)
    smooth = statistics.mean(len(encode_png(im)) for im in smooth_images(16, w["size"], 0))
    cpu_s, step = cpu_dit_forward(), f["denoiser"] / steps
    kb = [s / 1e3 for s in png["sizes"]]
    photos = ", ".join(f"{statistics.median(kb[i : i + 24]):.0f}" for i in range(0, len(kb), 24))
    cfg_h = [n * f["denoiser"] / (PEAK * m) / 3600 for m in reversed(MFU["dit"])]
    per_image = {k: v["per_image"] for k, v in shards.items()}
    written = "; ".join(
        f"{k}: {v['per_image'] / 1e3:.1f} KB per image ({v['png_share']:.1%} PNG), "
        f"{v['img_s']:.0f} img/s, {v['mb_s']:.0f} MB/s"
        for k, v in shards.items()
    )
    gen = cfg["generate"]
    return {
        "title": "Expected cost of an ImageNet CSM set",
        "rows": cost_rows(w, f, per_image, png, ann),
        "notes": [
            f"Work (imagenet presets, generate plan): {w['pairs']:,} pairs x "
            f"{w['series'] // w['pairs']} series x {w['members']} images = {n:,} images, "
            f"{w['shards']:,} shards; {gen.model}, {gen.sampler} {steps} steps, guidance "
            f"{gen.guidance} (one denoiser row per image: the dit backend and DiTPipeline double "
            f"it only above 1; guidance 4 adds {cfg_h[0]:,.0f} - {cfg_h[1]:,.0f} H100-hours), "
            f"batch {w['batch']}; real/train {w['real_train']:,} (ImageNet's {IMAGENET_TRAIN:,} "
            f"less the {w['real_val']:,} val split, about), test {w['real_test']:,}; "
            f"{cfg['train'].model}, {w['epochs']} epochs at {w['size']} px.",
            f"FLOPs per image (counted, 2 per multiply-add): DiT-XL/2 forward {step / 1e9:.1f} G "
            f"(the DiT paper's 118.6 GFLOPs are multiply-adds: x2 = 237.2) x {steps} steps = "
            f"{f['denoiser'] / 1e12:.2f} T; VAE decode {f['decode'] / 1e9:.0f} G; an image "
            f"{(f['denoiser'] + f['decode']) / 1e12:.2f} T, a series "
            f"{w['members'] * (f['denoiser'] + f['decode']) / 1e12:.1f} T. "
            f"{clip} at {f['clip_size']} px {f['clip'] / 1e9:.2f} G; "
            f"resnet50 at {w['size']} px {f['fwd'] / 1e9:.2f} G forward, {f['both'] / 1e9:.2f} G "
            "forward + backward. Not counted: elementwise ops, norms, the DDIM update.",
            f"H100-hours = FLOPs / ({PEAK / 1e12:.0f} TFLOP/s dense bf16 x MFU); the MFU ranges "
            "are assumed, none is measured (no GPU run exists: issue 16); docs/scale.md says why.",
            f"PNG, {len(kb)} crops of 3 photos at {w['size']} px (measured): median "
            f"{statistics.median(kb):.0f} KB, {min(kb):.0f} - {max(kb):.0f} KB (per photo: "
            f"{photos}); bench stream's smooth images: {smooth / 1e3:.0f} KB. One core: encode "
            f"{png['encode']:.0f} img/s, decode {png['decode']:.0f} img/s. The streaming path at "
            f"{w['size']} px (bench stream, smooth images, 2 shared cores): {_stream_rows()}.",
            f"One shard of each at its real size, by the shard writer (tar, fsync, sha256, offset "
            f"index, record): {written}. series/ may go once mixed/ (the same PNGs) is complete.",
            f"annotation.json: {ann / 1e3:,.1f} KB at 6,000 pairs, the same at any number above "
            "the per-pair table's cap (4,950 pairs; beyond it a summary); annotate's rank 0 keeps "
            "40 bytes of columns an image for it (bench annotate_report).",
            f"CPU sanity: one DiT-XL/2 forward, batch 1, fp32, one thread: {cpu_s:.1f} s "
            f"({step / cpu_s / 1e9:.0f} GFLOP/s); the generation at that rate: "
            f"{n * f['denoiser'] / (step / cpu_s) / 3.156e7:,.0f} core-years.",
            "To replace the assumptions where a GPU is lent: `python -m bench generate` (SD-1.5 "
            "stage MFU), `annotate` (ViT-L-14 img/s), `train` (ResNet-18 img/s); none times "
            "DiT-XL/2 or resnet50 at 256 px yet: `dit_xl2('cuda')` in bf16 at batch 64, timed, "
            "over these FLOP counts gives the generate MFU directly.",
        ],
    }
