"""The flat names of the stage configs' leaves: {stage: {flat name: tree path}}.

config.json records every leaf under its flat name (core.config.StageConfig.recorded), so the
config.json of every run written before the configs became trees keeps its bytes and every
existing root stays complete; `--set` still takes a flat name, saying its new path once. A leaf
not listed here is recorded under its path, which for a top-level field is its name.
docs/compat.md lists this table (tests/test_config_tree.py keeps the two equal).
"""

from __future__ import annotations

OPTIM = {
    "lr": "optim.lr",
    "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay",
    "milestones": "optim.milestones",
    "lr_gamma": "optim.lr_gamma",
    "clip_norm": "optim.clip_norm",
}
AUGMENT = {"crop_pad": "augment.crop_pad", "flip": "augment.flip"}
DATA = {
    "data_path": "data.path",
    "memory_budget_gb": "data.memory_budget_gb",
    "stream_workers": "data.stream_workers",
    "stream_prefetch": "data.stream_prefetch",
}
CHECKPOINT = {"checkpoint_limit": "checkpoint.limit", "resume": "checkpoint.resume"}

LEGACY: dict[str, dict[str, str]] = {
    "train": {**OPTIM, **AUGMENT, **DATA, **CHECKPOINT},
    "finetune": {
        **{k: OPTIM[k] for k in ("momentum", "weight_decay", "clip_norm")},
        **AUGMENT,
        "maccal_epochs": "maccal.epochs",
        "maccal_lr": "maccal.lr",
        "maccal_r": "maccal.r",
        "fedlas_epochs": "fedlas.epochs",
        "fedlas_lr": "fedlas.lr",
        **DATA,
        **CHECKPOINT,
    },
    "evaluate": DATA,
}


def legacy_names(stage: str) -> dict[str, str]:
    """A stage's {flat name: path} (its Config's LEGACY)."""
    return LEGACY.get(stage, {})
