"""The config.json text of every stage x preset (and chain steps and some off-default
variants): what `tests/test_config_bytes.py` compares with tests/data/config_json.json.

`python tests/config_dump.py > tests/data/config_json.json` rewrites the snapshot; do that only
when a change means to change what runs record (their roots would then no longer be complete).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.io import canonical_json
from pipeline.registry import STAGES, resolve_stage_config
from shards.writer import NOT_IDENTITY
from stages.presets import NAMES, chain_steps

# values a stage needs to resolve at all (finetune names the run it tunes)
REQUIRED = {"finetune": ("run=csm",)}
# off-default variants: the fields a study, a chain or a user sets
VARIANTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "train": (
        ("loss=csm",),
        ("loss=focal",),
        ("loss=focal", "focal_gamma=2"),
        ("loss=csm", "csm_weight=2", "csm_sharpening=8"),
        ("loss=mmce", "mmce_normalization=focal_calibration"),
        ("loss=fedlas-mbls",),
        ("tracker=tensorboard",),
        ("seeds=1,2", "seed=3"),
        ("lr=0.05", "momentum=0.8", "clip_norm=0", "flip=false", "crop_pad=0"),
        ("checkpoint_limit=3", "precision=fp32", "train_limit=100", "data_path=stream"),
        ("resume=", "run=x", "epochs=3", "milestones=1,2", "lr_gamma=0.5"),
    ),
    "finetune": (
        ("run=csm", "method=fedlas-ls"),
        ("run=csm", "method=fedlas-mbls", "flip=false", "clip_norm=1"),
        ("run=ce", "maccal_r=64", "maccal_epochs=3", "precision=fp32", "checkpoint_limit=1"),
    ),
    "fit-generator": (
        ("judge_run=judge", "clip_choice=true", "report_judges=a,b"),
        ("prediction_type=v_prediction", "zero_terminal_snr=true", "hflip=true"),
        ("mixed_precision=bf16", "checkpoints_total_limit=3", "grad_clip=0.5", "steps=10"),
    ),
    "generate": (
        ("endpoint_check=redraw", "endpoint_judge=encoder"),
        ("mix_classes=3", "tuples=2"),
        ("dtype=bf16", "steps=5", "guidance=2", "limit=3"),
        ("backend=dit", "model=facebook/DiT-XL-2-256"),
    ),
    "annotate": (
        ("fidelity_run=judge", "train_limit=100", "precision=bf16"),
        ("encoder=classifier", "encoder_run=encoder", "method=ratio"),
    ),
    "evaluate": (("runs=a,b", "ts_criterion=ece"),),
    "prepare": (("resize=center-crop", "image_size=16"),),
    "shift": (("limit=10", "corruptions=gaussian_noise"),),
}


def cases() -> Iterator[tuple[str, str, str, tuple[str, ...]]]:
    """(name, stage, preset, --set values) of every case the snapshot holds; a chain step is
    named by its place in the chain, not by how the preset spells its values."""
    for stage in STAGES:
        for preset in NAMES:
            sets = REQUIRED.get(stage, ())
            yield " ".join([stage, preset, *sets]), stage, preset, sets
    for preset in NAMES:
        for i, (stage, extra) in enumerate(chain_steps(preset)):
            yield f"chain {preset} step {i} {stage}", stage, preset, tuple(extra)
    for stage, variants in VARIANTS.items():
        for preset in ("digits", "cifar10"):
            for sets in variants:
                yield " ".join([stage, preset, *sets]), stage, preset, sets


def config_json(stage: str, preset: str, sets: tuple[str, ...]) -> str:
    """The text a run of this config writes as config.json (shards.writer.write_config)."""
    recorded = resolve_stage_config(stage, preset, sets).recorded()
    kept = {k: v for k, v in recorded.items() if k not in NOT_IDENTITY}
    return canonical_json(kept).decode()


def dump() -> dict[str, str]:
    """{"stage preset set set ...": config.json text (or the error a case raises)}."""
    out: dict[str, str] = {}
    for key, stage, preset, sets in cases():
        try:
            out[key] = config_json(stage, preset, sets)
        except Exception as e:  # a case that does not resolve is recorded as its error
            out[key] = f"error: {type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    print(json.dumps(dump(), indent=1, sort_keys=True, ensure_ascii=False))
