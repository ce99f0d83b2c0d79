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
        "method": "objective",  # a renamed leaf, not a flat one: `method` is the study's word
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
    "generate": {
        "steps": "sample_steps",
        "dtype": "precision",
        **{
            name: f"mixing.{name}"
            for name in ("alphas", "series_per_pair", "pairs", "mix_classes", "lattice")
        },
        **{name: f"mixing.{name}" for name in ("tuples", "series_per_tuple", "limit")},
        "series_per_shard": "shards.series_per_shard",
        "min_shards": "shards.min_shards",
        "endpoint_check": "endpoint.check",
        "endpoint_judge": "endpoint.judge",
        "endpoint_tries": "endpoint.tries",
    },
    "annotate": {"method": "annotator", "fidelity_run": "judge"},
    "fit-generator": {
        "steps": "train_steps",
        "lr": "optim.lr",
        "warmup_steps": "optim.warmup_steps",
        "lr_schedule": "optim.lr_schedule",
        "weight_decay": "optim.weight_decay",
        "grad_clip": "optim.clip_norm",
        "ema_decay": "optim.ema_decay",
        "min_snr_gamma": "optim.min_snr_gamma",
        "prediction_type": "noise.prediction_type",
        "num_train_timesteps": "noise.num_train_timesteps",
        "beta_schedule": "noise.beta_schedule",
        "zero_terminal_snr": "noise.zero_terminal_snr",
        "hflip": "augment.flip",
        "mixed_precision": "precision",
        "judge_run": "fidelity.judge",
        "report_judges": "fidelity.report_judges",
        "guidance_grid": "fidelity.guidance_grid",
        "clip_choice": "fidelity.clip_choice",
        "fidelity_every": "fidelity.every",
        "fidelity_per_class": "fidelity.per_class",
        "checkpoint_every": "checkpoint.every",
        "checkpoints_total_limit": "checkpoint.limit",
        "resume": "checkpoint.resume",
        "samples_per_class": "preview.per_class",
        "sample_steps": "preview.sample_steps",
    },
}


def legacy_names(stage: str, parts: dict[str, str] | None = None) -> dict[str, str]:
    """A stage's {flat name: path} (its Config's LEGACY): the table's, and `parts`, those its
    section of parts derives from the parts' parameters (train's loss: `csm_weight` ->
    `loss.csm.weight`, core.parts.Section.tree), so a loss's names are stated once, at the loss."""
    return {**LEGACY.get(stage, {}), **(parts or {})}
