"""Weights of trained runs on disk: `model.safetensors` + `model.json`.

`model.json` says how to rebuild the network and feed it:
    {"arch": <Classifier.arch_config()>, "class_names": [...], "image_size": int,
     "normalize": {"mean": [...], "std": [...]}, ...anything else the writer adds}
Stages rebuild with `models.classifiers.classifier_from_config(meta["arch"])` and load the
state dict. Weights are safetensors: loading never unpickles anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from shards.io import atomic_write_json, read_json, tmp_path_for
from shards.manifest import ShardError

WEIGHTS = "model.safetensors"
META = "model.json"


def save_weights(
    folder: Path, state_dict: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> Path:
    """Weights first, then model.json: a folder with model.json has complete weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    tmp = tmp_path_for(folder / WEIGHTS)
    save_file(tensors, str(tmp))
    tmp.replace(folder / WEIGHTS)
    atomic_write_json(folder / META, dict(meta))
    return folder / WEIGHTS


def load_weights(
    folder: Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    folder = Path(folder)
    if not (folder / META).is_file() or not (folder / WEIGHTS).is_file():
        raise ShardError(
            f"{folder} has no trained weights ({WEIGHTS} + {META}); train the run first "
            "(make train RUN=...) or check the run name"
        )
    return load_safetensors(folder / WEIGHTS, device), read_json(folder / META)


def load_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file, or one line naming it when it is not one (e.g. a pickle renamed)."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as e:
        raise ShardError(
            f"{path} is not a readable safetensors file ({str(e).strip()[:80]}); "
            "it is damaged or of another format: rewrite it (rerun the stage that wrote it)"
        ) from e


def load_model(
    folder: Path, build: Callable[[dict[str, Any]], nn.Module], device: str | torch.device = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """A trained run's network with its weights loaded, and its model.json.

    `build` turns `meta["arch"]` into the network (e.g. models.finetuning.build_model); it is
    passed in so that this on-disk module stays free of model code.
    """
    state, meta = load_weights(folder, device)
    missing = [k for k in ("arch", "class_names", "image_size", "normalize") if k not in meta]
    if missing:
        raise ShardError(
            f"{Path(folder) / META} lacks {missing}; retrain the run with this version"
        )
    model = build(meta["arch"])
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ShardError(
            f"{folder}: weights do not fit the architecture in {META} ({first})"
        ) from e
    return model.to(device), meta
