"""digits: scikit-learn's 1,797 real 8x8 handwritten digits, the embedded default (offline, CPU).

`make generate` (no arguments) runs this chain on 2 CPU cores in minutes: a quick real-only
classifier whose pooled features are the annotation space (CLIP means nothing on 8x8 digits),
the tiny in-house UNet, series, soft labels.
"""

from __future__ import annotations

from stages.presets.base import Preset


def _read(cfg):
    from shards.sources import digits_source

    return digits_source()


PRESET = Preset(
    name="digits",
    stages={
        # 8x8 originals upsampled to 16x16, the size the tiny in-house UNet works at
        "prepare": dict(source="digits", image_size=16, shard_size=128),
        # well under a minute on 2 CPU cores, > 90 % test accuracy; grey 16x16 digits, no flips
        # (a mirrored digit is another symbol). One CPU thread: this tiny net gains little from
        # a second one and runs ~3-7x slower when the cores are shared with other jobs (OpenMP
        # spin-waits). FeDLaS uses the CIFAR-10 values (the config's defaults).
        "train": dict(model="digits-cnn", in_channels=1, epochs=30, batch_size=64, cpu_threads=1)
        | {"optim.lr": 0.05, "optim.milestones": (20, 26)}
        | {"augment.crop_pad": 2, "augment.flip": False},
        # The fit takes about 5 minutes on 2 CPU cores (fp32: ~0.31 s per step at batch 128; for
        # this ~1 M-parameter net at 16 px bf16 autocast's casts cost what its kernels save: 0.42
        # s a step on an Intel Xeon with AMX, bench/RESULTS.md); a high learning rate because
        # the run is short. Linear betas: with the cosine schedule the same 500 steps leave
        # colour casts (the digits are grey) in the samples.
        # 800 steps with label dropout, a cosine lr decay and Min-SNR-5 weighting: the chain's
        # encoder takes 99.5 % of the endpoints for their digit at w = 2 (DDIM 15, fp32; 95.5 %
        # at w = 1.5 with DDIM 25 in bf16; the constant-lr recipe without Min-SNR: 90 % at 750
        # steps, 94 % at 1,000; w = 3 collapses to ~37 %); ~4.5 min on 2 cores
        # (docs/generate.md, "Guidance")
        "fit-generator": {
            "unet": "digits-tiny",
            "train_steps": 800,
            "batch_size": 128,
            "optim.lr": 2e-3,
            "optim.lr_schedule": "cosine",
            "optim.min_snr_gamma": 5.0,
            "optim.ema_decay": 0.995,
            "fidelity.judge": "encoder",
            "fidelity.guidance_grid": (1.0, 1.5, 2.0),
            # one check, at the end: `make generate` within 8 min on 2 cores
            "fidelity.every": 0,
            # the fidelity check and sample grid sample as generate does
            "preview.sample_steps": 15,
            "precision": "no",  # fp32: faster than bf16 autocast for this tiny net (above)
        },
        # the in-house UNet of fit-generator; 45 pairs x 6 = 270 series, 2160 images (~1.5 min,
        # 2 cores). DDIM 15: on the fresh-clone chain as faithful as 25 (99.1 % vs 95.9 % of the
        # pure images their digit, the fit's own check chose w = 2) in 60 % of the time
        # (docs/generate.md)
        "generate": dict(backend="unet", sample_steps=15, batch_size=64)
        | {"mixing.series_per_pair": 6, "endpoint.judge": "encoder"},
        # the real-only classifier's pooled features (train run "encoder") are the annotation
        # space (docs/architecture.md). workers=0: on the few CPU cores digits targets, decode
        # processes would fight the encoder. Sharpening: CIFAR-10's 4.0 (docs/methods.md §2 uses 2.3
        # only for the 100-class set, where prototypes crowd closer).
        "annotate": dict(encoder="classifier", sharpening=4.0, workers=0, judge="encoder"),
        # the train recipe's augmentation (crop pad 2, no flips) and its last lr (0.05 / 100)
        # for FeDLaS; MaC-Cal keeps docs/methods.md's lr 0.1 and batch 128 but runs 20 epochs (its q
        # schedule scales with the epoch count). Seconds on 2 CPU cores. FeDLaS: CIFAR-10's.
        "finetune": {
            "augment.crop_pad": 2,
            "augment.flip": False,
            "maccal.epochs": 20,
            "fedlas.epochs": 5,
            "fedlas.lr": 0.0005,
            "cpu_threads": 1,
        },
    },
    # a quick real-only classifier first: its features are the annotation space
    chain=(
        ("prepare", ()),
        ("train", ("run=encoder", "loss=ce")),
        ("fit-generator", ()),
        ("generate", ()),
        ("annotate", ()),
    ),
    reads=_read,
    reads_fields=(),
    data_license=(
        "cc-by-4.0",
        "scikit-learn's handwritten digits (UCI Optical Recognition of Handwritten Digits)",
    ),
)
