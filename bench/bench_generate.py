"""generate-stage throughput vs the bare sampling loop on the same model and images.

CPU (always): the digits-tiny UNet (random weights: speed does not depend on them), N series of
K = 8 at 25 DDIM steps; the stage (plan, noise, sampling, uint8, PNG, tar, sha256, preview,
manifest) vs a bare loop of UNet calls + scheduler steps over the same rows in the same batches.
Goal: ratio >= 0.9.

GPU only (skipped without CUDA): the SD-1.5 architecture with random weights, 512x512, 25 steps,
guidance 7.5, bf16: our stage vs a plain per-image `pipe(prompt)` loop, images/s and model FLOP
utilisation (FLOPs counted with torch.utils.flop_counter on one step, peak from the GPU's name).
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DDPMScheduler

from core.io import sha256_file
from core.launch import cpu_threads
from core.seeding import derive_seed
from models.generators import load_unet, save_unet, unet_from_preset
from models.generators.base import class_weights, make_mixable
from models.generators.loading import dtype_kwarg
from models.generators.schedulers import make_scheduler
from pipeline.registry import run_stage
from shards.manifest import Manifest, manifest_digest, write_manifest
from shards.writer import ShardFolder
from stages.configs.generate import Config as GenerateConfig

CPU_SERIES, K, STEPS, BATCH = 48, 8, 25, 64
GPU_SERIES = 16  # x K = 128 images at 512x512
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def _real(root: Path, classes: int, size: int) -> None:
    """A minimal real/train (the stage reads class names and image size from it)."""
    folder = ShardFolder(root / "real" / "train", "train")
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (classes, size, size, 3), generator=g, dtype=torch.uint8)
    folder.write(
        0, [{"__key__": f"train_{i:07d}", "png": images[i], "cls": i} for i in range(classes)]
    )
    names = [f"class{c}" for c in range(classes)]
    folder.finish(1, kind="real", class_names=names, info={"image_size": size})


def _unet_generator(root: Path) -> Path:
    folder = root / "generator"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        unet = unet_from_preset("digits-tiny", 10)
    save_unet(folder, unet, DDPMScheduler(timestep_spacing="trailing"))  # fmt: skip
    info = {"image_size": 16, "weights_sha256": sha256_file(folder / "unet" / "diffusion_pytorch_model.safetensors")}  # fmt: skip
    upstream = {"real": manifest_digest(root / "real" / "train")}
    names = tuple(f"class{c}" for c in range(10))
    write_manifest(folder, Manifest(kind="generator", class_names=names, shards=(), upstream=upstream, info=info))  # fmt: skip
    return folder


def _rows(n_series: int, n_classes: int):
    """The stage's rows (a, b, α, noise seed) for the first n series of the default plan."""
    pairs = [(a, b) for a in range(n_classes) for b in range(a + 1, n_classes)]
    a, b, alpha, seeds = [], [], [], []
    for s in range(n_series):
        for k in range(K):
            a.append(pairs[s % len(pairs)][0])
            b.append(pairs[s % len(pairs)][1])
            alpha.append(k / (K - 1))
            seeds.append(derive_seed(0, "series", s))
    return torch.tensor(a), torch.tensor(b), torch.tensor(alpha), seeds


@torch.inference_mode()
def _bare_unet_loop(folder: Path) -> float:
    """Seconds for the plain DDIM loop over the same rows and batches (no uint8, no files)."""
    unet, config = load_unet(folder)
    make_mixable(unet, "class_embedding")
    unet.eval()
    sched = make_scheduler("ddim", config)
    a, b, alpha, seeds = _rows(CPU_SERIES, 10)
    t0 = time.perf_counter()
    noise = {
        s: torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in set(seeds)
    }
    for start in range(0, len(a), BATCH):
        rows = slice(start, start + BATCH)
        x = torch.stack([noise[s] for s in seeds[rows]])
        cond = class_weights(a[rows], b[rows], alpha[rows], 10)
        sched.set_timesteps(STEPS)
        for t in sched.timesteps:
            eps = unet(x, t, class_labels=cond).sample
            x = sched.step(eps, t, x).prev_sample
    return time.perf_counter() - t0


def _stage(root: Path, sets: list[str], preset: str = "digits") -> float:
    shutil.rmtree(root / "series", ignore_errors=True)
    t0 = time.perf_counter()
    run_stage("generate", preset, [f"out={root.parent}", f"name={root.name}", *sets])
    return time.perf_counter() - t0


GENERATE_THREADS = GenerateConfig.cpu_threads  # the stage's default


def cpu_section(tmp: Path) -> list[dict]:
    root = tmp / "digits"
    _real(root, 10, 16)
    folder = _unet_generator(root)
    # shards of BATCH rows: the stage makes the same model calls as the bare loop
    sets = [f"mixing.limit={CPU_SERIES}", f"mixing.alphas={K}", f"sample_steps={STEPS}",
            f"batch_size={BATCH}", "device=cpu", f"shards.series_per_shard={BATCH // K}"]  # fmt: skip
    n = CPU_SERIES * K
    stage, bare = [], []
    for _ in range(3):  # alternate, best of 3: the machine is shared
        with cpu_threads(GENERATE_THREADS):  # the stage pins its threads: so must the baseline
            bare.append(_bare_unet_loop(folder))
        stage.append(_stage(root, sets))
    s, b = n / min(stage), n / min(bare)
    return [
        {"section": "CPU, digits-tiny UNet 16x16", "images": n, "stage (img/s)": f"{s:.1f}",
         "baseline (img/s)": f"{b:.1f}", "baseline": "bare DDIM loop", "ratio stage/baseline": f"{s / b:.2f}",
         "MFU stage": "", "MFU baseline": ""},
    ]  # fmt: skip


# ---------------------------------------------------------------- GPU: SD-1.5 architecture


def save_sd(folder: Path, tiny: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
    """SD-1.5's architecture with random weights (``tiny``: a toy of the same layout, for a CPU
    smoke run of this code)."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for tok in [c + sfx for sfx in ("", "</w>") for c in string.ascii_lowercase + string.digits]:
        vocab[tok] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)  # fmt: skip
    width, layers = (16, 1) if tiny else (768, 12)
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=width, intermediate_size=4 * width, num_attention_heads=max(1, width // 64),
        num_hidden_layers=layers, max_position_embeddings=77, hidden_act="quick_gelu",
    ))  # fmt: skip
    ch = (8, 16, 16, 16) if tiny else (320, 640, 1280, 1280)
    unet = UNet2DConditionModel(
        sample_size=8 if tiny else 64, block_out_channels=ch, layers_per_block=1 if tiny else 2,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=width, attention_head_dim=8, norm_num_groups=8 if tiny else 32,
    )  # fmt: skip
    vch = (8, 8, 8, 8) if tiny else (128, 256, 512, 512)
    vae = AutoencoderKL(
        block_out_channels=vch, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1 if tiny else 2,
        latent_channels=4, norm_num_groups=8 if tiny else 32, sample_size=64 if tiny else 512,
    )  # fmt: skip
    sched = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )  # fmt: skip
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=sched,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipe.to(dtype).save_pretrained(folder)


def _flops_per_image(pipe, steps: int, guidance: float) -> float:
    """Model FLOPs of one image: `steps` UNet calls (x2 rows with guidance) + one VAE decode."""
    from torch.utils.flop_counter import FlopCounterMode

    dev, dt = pipe.device, pipe.unet.dtype
    size = pipe.unet.config.sample_size
    rows = 2 if guidance > 1 else 1
    x = torch.randn(rows, 4, size, size, device=dev, dtype=dt)
    ctx = torch.randn(rows, 77, pipe.unet.config.cross_attention_dim, device=dev, dtype=dt)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as unet_flops:
            pipe.unet(x, torch.tensor(500, device=dev), encoder_hidden_states=ctx)
        with FlopCounterMode(display=False) as vae_flops:
            pipe.vae.decode(x[:1])
    return steps * unet_flops.get_total_flops() + vae_flops.get_total_flops()


def gpu_section(tmp: Path, device: str = "cuda", tiny: bool = False, n_series: int = GPU_SERIES) -> list[dict]:  # fmt: skip
    from diffusers import StableDiffusionPipeline

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tmp / "sd15-random"
    save_sd(model, tiny=tiny, dtype=dtype)
    root = tmp / "cifar10"
    _real(root, 10, 32)
    steps, guidance, n = 25, 7.5, n_series * K
    precision = "bfloat16" if device == "cuda" else "float32"
    sets = [f"model={model}", f"mixing.limit={n_series}", f"mixing.alphas={K}", f"sample_steps={steps}",
            f"guidance={guidance}", f"device={device}", f"precision={precision}", "batch_size=16",
            "shards.series_per_shard=2"]  # fmt: skip
    _stage(root, [*sets[:1], "mixing.limit=1", *sets[2:]], "cifar10")  # warm-up: kernels, caches
    stage = _stage(root, sets, "cifar10")
    pipe = StableDiffusionPipeline.from_pretrained(model, **dtype_kwarg(dtype), safety_checker=None, requires_safety_checker=False).to(device)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    pipe("a photo of a class0", num_inference_steps=steps, guidance_scale=guidance)  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        pipe(f"a photo of a class{i % 10}", num_inference_steps=steps, guidance_scale=guidance,
             generator=torch.Generator().manual_seed(i))  # fmt: skip
    sync()
    plain = time.perf_counter() - t0
    flops = _flops_per_image(pipe, steps, guidance)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    s, p = n / stage, n / plain
    mfu = (lambda r: f"{100 * r * flops / peak:.1f}%") if peak else (lambda r: "?")
    return [
        {"section": f"GPU ({name}), SD-1.5 arch random weights 512x512, 25 steps, g 7.5, bf16",
         "images": n, "stage (img/s)": f"{s:.2f}", "baseline (img/s)": f"{p:.2f}",
         "baseline": "per-image pipe(prompt)", "ratio stage/baseline": f"{s / p:.2f}",
         "MFU stage": mfu(s), "MFU baseline": mfu(p)},
    ]  # fmt: skip


def run() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-generate-"))
    try:
        rows = cpu_section(tmp)
        notes = [
            f"CPU: {CPU_SERIES} series x {K} alphas, {STEPS} DDIM steps, {BATCH} rows per model call "
            "(stage: one shard = one call), float32, "
            "best of 3 alternating runs; the stage time includes model loading, PNG/tar/sha256, "
            "preview.png and the manifest.",
        ]
        if torch.cuda.is_available():
            rows += gpu_section(tmp)
            notes.append(
                f"GPU: {GPU_SERIES * K} images after a warm-up; stage batch 16 rows (x2 with "
                "guidance); MFU = counted model FLOPs per image x images/s / the GPU's dense bf16 peak."
            )
        else:
            notes.append("GPU section (SD-1.5 architecture, bf16): skipped, no CUDA device here.")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"title": "Generate stage vs bare sampling", "rows": rows, "notes": notes}
