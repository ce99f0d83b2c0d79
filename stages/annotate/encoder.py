"""annotate, part 1: the annotation space, an image encoder and the class prototypes (docs/methods.md §2).

The encoder comes from the one registry of encoder kinds (models.encoders.ENCODERS, named in the
config through ENCODER_KINDS); this module only turns config fields into its arguments. The
prototypes are computed once by rank 0 and saved in mixed/ with a key of everything they depend
on, so a rerun with the same encoder and real/train reuses them instead of encoding real/ again.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from core.io import atomic_write_json, read_json, sha256_file, tmp_path_for, writing
from core.logs import log, progress
from core.precision import resolve_precision
from models.annotation import PrototypeAccumulator
from models.annotation import text_prototypes as encode_text_prototypes
from models.classifiers import NAME_KEYS, classifier_from_config
from models.encoders import ImageEncoder
from models.encoders import build_encoder as build_encoder_kind
from shards.manifest import ShardError, manifest_digest, read_manifest
from shards.reader import iter_folder
from shards.runs import WEIGHTS, load_model
from stages.configs.annotate import ENCODER_KINDS, Config

PROTOTYPES = "prototypes.safetensors"
PROTOTYPES_META = "prototypes.json"


# ---------------------------------------------------------------- the encoder


def _classifier_args(cfg: Config) -> dict[str, Any]:
    """The `module` kind over runs/<classes>/train/<encoder.classifier.run>/: its pooled
    pre-classifier features at its own input size and normalisation, named by run, architecture
    and weights.
    The architecture by its name only: the weights' sha256 pins its widths (each one a tensor's
    shape), and so an encoder's identity, mixed/ with it, stays what it was before model.json
    held the whole arch config."""
    run = cfg.encoder.classifier.run
    folder = cfg.root / "train" / run
    try:
        model, meta = load_model(folder, classifier_from_config)
    except ShardError as e:
        raise ShardError(f"encoder.classifier.run={run}: {e}") from e
    identity = {
        "run": run,
        "arch": {k: v for k, v in meta["arch"].items() if k in NAME_KEYS},
        "weights_sha256": sha256_file(folder / WEIGHTS),
    }
    norm = meta["normalize"]
    return dict(
        module=model,
        image_size=int(meta["image_size"]),
        mean=norm["mean"],
        std=norm["std"],
        identity=identity,
    )


def _openclip_args(cfg: Config) -> dict[str, Any]:
    own = cfg.encoder.openclip
    return dict(model_name=own.model, pretrained=own.pretrained, cache_dir=own.cache or None)


def _hf_clip_args(cfg: Config) -> dict[str, Any]:
    # its model: the leaf both CLIP kinds share (encoder.openclip.model)
    return dict(model_id_or_folder=cfg.encoder.params()["model"])


# encoder= -> the constructor arguments of its kind, from the config
ENCODER_ARGS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "classifier": _classifier_args,
    "openclip": _openclip_args,
    "hf-clip": _hf_clip_args,
}


def build_encoder(cfg: Config, device: torch.device) -> ImageEncoder:
    kind = ENCODER_KINDS[cfg.encoder.name]
    # the encoder casts by itself (autocast), so no launcher has a say (core/precision.py)
    precision = resolve_precision("precision", cfg.precision, device, launcher=False)
    common = dict(device=device, batch_size=cfg.batch_size, precision=precision)
    return build_encoder_kind(kind, **ENCODER_ARGS[cfg.encoder.name](cfg), **common)


# ---------------------------------------------------------------- the prototypes


def prototype_key(cfg: Config, encoder: ImageEncoder, class_names, real: Path | None) -> dict:
    """Everything the prototypes depend on: equal key -> the saved ones are reused."""
    return {
        "encoder": encoder.identity,
        "source": cfg.prototypes,
        "class_names": list(class_names),
        "real": manifest_digest(real) if real is not None else None,
        "templates": list(cfg.text_templates) if cfg.prototypes == "text" else None,
    } | ({"train_limit": cfg.train_limit} if cfg.train_limit else {})


def compute_prototypes(cfg: Config, encoder: ImageEncoder, class_names, real: Path | None):
    """[C, d]: class means of the real/train features (docs/methods.md §2), or zero-shot text features."""
    if cfg.prototypes == "text":
        return encode_text_prototypes(encoder, class_names, cfg.text_templates), []
    acc = PrototypeAccumulator(len(class_names))
    n = read_manifest(real).num_samples
    n = min(n, cfg.train_limit) if cfg.train_limit else n  # the first n, as train reads them
    with progress(range(n), total=n, desc="prototypes", unit="img") as bar:
        images, labels = [], []
        for sample in itertools.islice(iter_folder(real), n):
            images.append(sample["image"])
            labels.append(sample["cls"])
            if len(images) == cfg.batch_size:
                acc.update(encoder.encode(torch.from_numpy(np.stack(images))), torch.tensor(labels))
                bar.update(len(images))
                images, labels = [], []
        if images:
            acc.update(encoder.encode(torch.from_numpy(np.stack(images))), torch.tensor(labels))
            bar.update(len(images))
    return acc.prototypes(), acc.counts.tolist()


def ensure_prototypes(cfg: Config, encoder, class_names, real, mixed: Path) -> None:
    """Rank 0: reuse mixed/prototypes.* if their key matches, else compute and save them."""
    key = prototype_key(cfg, encoder, class_names, real)
    meta_path = mixed / PROTOTYPES_META
    saved = read_json(meta_path).get("key") if meta_path.is_file() else None
    if (mixed / PROTOTYPES).is_file() and saved == json.loads(json.dumps(key)):
        log.info("annotate: reusing %s", mixed / PROTOTYPES)
        return
    protos, counts = compute_prototypes(cfg, encoder, class_names, real)
    tmp = tmp_path_for(mixed / PROTOTYPES)
    with writing(mixed / PROTOTYPES, tmp):  # safetensors' I/O errors name the file
        save_file({"prototypes": protos.contiguous()}, str(tmp))
        os.replace(tmp, mixed / PROTOTYPES)
    atomic_write_json(meta_path, {"key": key, "counts": counts, "shape": list(protos.shape)})


def load_prototypes(mixed: Path, num_classes: int) -> torch.Tensor:
    protos = load_file(str(mixed / PROTOTYPES))["prototypes"]
    if protos.ndim != 2 or protos.shape[0] != num_classes:
        raise ShardError(
            f"{mixed / PROTOTYPES}: shape {tuple(protos.shape)}, need [{num_classes}, d]"
        )
    return protos
