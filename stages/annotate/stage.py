"""annotate's run: check the inputs, then the prototypes, the mixed shards, the report and,
last, the manifest (the stage is described in stages/annotate/__init__.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.config import given_folder
from core.io import atomic_write_bytes, atomic_write_json, read_json, sha256_file
from core.launch import Processes
from core.logs import log, progress
from core.version import code_version
from models.annotation import ANNOTATORS
from shards.manifest import (
    MANIFEST,
    Manifest,
    ShardError,
    check_shard,
    manifest_digest,
    read_manifest,
)
from shards.reader import read_raw_shard
from shards.writer import DONE_DIR, ShardFolder, check_config, completed, write_config
from stages.annotate.encoder import PROTOTYPES, build_encoder, ensure_prototypes, load_prototypes
from stages.annotate.mixed import annotate_shards
from stages.annotate.report import (
    columns,
    concat_columns,
    generator_fidelity,
    log_summary,
    report,
)
from stages.configs.annotate import Config

INPUTS = "inputs.json"  # in .done/: what the completed shards were computed from


# ---------------------------------------------------------------- 1. inputs


def check_inputs(cfg: Config) -> tuple[Path, Manifest, Path | None]:
    """(series folder, its manifest, real/train or None): refuse bad input early,
    on every rank alike, before anything is written."""
    series = cfg.root / "series"
    if cfg.series:
        hint = f"point it at a complete series folder, or unset it for {series}"
        series = given_folder("series", cfg.series, hint)
    series_m = read_manifest(series)
    if series_m.kind != "series":
        raise ShardError(f"{series} holds a '{series_m.kind}' folder, not generated series")
    if series_m.num_samples == 0:
        raise ShardError(f"{series} holds no series (0 samples); rerun generate")
    if cfg.prototypes != "real" or not ANNOTATORS[cfg.annotator].needs_features:
        return series, series_m, None
    real = cfg.root / "real" / "train"
    real_m = read_manifest(real)
    if real_m.class_names != series_m.class_names:
        raise ShardError(
            f"class lists differ: {series} has {len(series_m.class_names)} classes "
            f"({', '.join(series_m.class_names[:5])}, ...), {real} has "
            f"{len(real_m.class_names)} ({', '.join(real_m.class_names[:5])}, ...)"
        )
    return series, series_m, real


def upstream_digests(series: Path, real: Path | None) -> dict[str, str]:
    """What mixed/ is built from: its manifest's `upstream`."""
    upstream = {"series": manifest_digest(series)}
    if real is not None:
        upstream["real"] = manifest_digest(real)
    return upstream


def already_complete(cfg: Config, mixed: Path, series: Path, real: Path | None, encoder) -> bool:
    """mixed/ is complete for this config, these upstream folders and this encoder: a rerun
    only reads (it also works on read-only media)."""
    if not completed(mixed, cfg.recorded(), upstream_digests(series, real)):
        return False
    done = read_manifest(mixed).info.get("annotation", {}).get("encoder")
    if encoder is not None and done != json.loads(json.dumps(encoder.identity)):
        return False  # e.g. a retrained encoder run under the same name: annotate again
    log.info("annotate: %s is complete already", mixed)
    return True


def reset_if_inputs_changed(folder: ShardFolder, inputs: dict) -> None:
    """Rank 0: completed shards stay valid only for the same series, encoder and prototypes.

    The config alone does not pin them (a retrained encoder run keeps its name), so a change
    here drops the manifest and every completion record: all shards are redone.
    """
    path = folder.folder / DONE_DIR / INPUTS
    if path.is_file() and read_json(path) == json.loads(json.dumps(inputs)):
        return
    (folder.folder / MANIFEST).unlink(missing_ok=True)
    for rec in (folder.folder / DONE_DIR).glob(f"{folder.prefix}-*.json"):
        rec.unlink()
    atomic_write_json(path, inputs)


# ---------------------------------------------------------------- the stage


def run(cfg: Config) -> Path:
    # 1. Check inputs (every rank, before anything is written or waited for).
    series, series_m, real = check_inputs(cfg)
    # accelerate sees torchrun's ranks on a CPU-only machine only when asked for the CPU
    procs = Processes(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    mixed = cfg.root / "mixed"
    class_names = series_m.class_names
    needs_features = ANNOTATORS[cfg.annotator].needs_features
    device = torch.device(cfg.device) if cfg.device else procs.device
    encoder = build_encoder(cfg, device) if needs_features else None
    if already_complete(cfg, mixed, series, real, encoder):
        return mixed
    if procs.is_main:
        write_config(mixed, cfg.recorded())
    else:  # other ranks only compare (rank 0 writes, or replaces a folder that never completed)
        check_config(mixed, cfg.recorded())
    folder = ShardFolder(mixed, prefix="mixed")
    n_shards = len(series_m.shards)
    log.info(
        "annotate %s: %d images in %d shards, annotator %s, encoder %s, %d process(es) -> %s",
        series,
        series_m.num_samples,
        n_shards,
        cfg.annotator,
        cfg.encoder.name,
        procs.world,
        mixed,
    )

    # 2. Prototypes: rank 0 computes (or reuses) them; everyone loads the saved tensor.
    if procs.is_main:
        if needs_features:
            ensure_prototypes(cfg, encoder, class_names, real, mixed)
        inputs = {
            "series": manifest_digest(series),
            "prototypes": sha256_file(mixed / PROTOTYPES) if needs_features else None,
            "encoder": encoder.identity if needs_features else None,
        }
        reset_if_inputs_changed(folder, inputs)
    procs.barrier()
    prototypes = load_prototypes(mixed, len(class_names)) if needs_features else None

    # 3. Mixed shard i from series shard i, shards i ≡ rank (mod world); complete ones skipped.
    mine = procs.my_shards(n_shards)
    todo = {i: series_m.shards[i] for i in mine if folder.done(i) is None}
    total = sum(series_m.shards[i].count for i in mine)
    with progress(
        range(total), total=total, desc="annotate", unit="img", enabled=procs.is_main
    ) as bar:
        bar.update(total - sum(rec.count for rec in todo.values()))
        cols = annotate_shards(cfg, todo, series, folder, encoder, prototypes, bar)
    procs.barrier()
    if not procs.is_main:
        return mixed

    # 4. Report (rank 0): json of shards it did not annotate itself is read back from mixed/,
    # each shard turned into columns at once (never a dict per image of the whole set).
    for i in range(n_shards):
        if i not in cols:
            rec = folder.done(i)
            if rec is None:
                raise ShardError(f"{folder.path(i)} is not complete after all ranks finished")
            check_shard(folder.path(i), rec)
            cols[i] = columns([json.loads(r["json"]) for r in read_raw_shard(folder.path(i))])
    fidelity = generator_fidelity(cfg, series, class_names, device)
    endpoint = series_m.info.get("endpoint_check")
    stats = report(
        cfg, concat_columns([cols[i] for i in range(n_shards)]), mixed, fidelity, endpoint
    )
    if (series / "preview.png").is_file():
        atomic_write_bytes(mixed / "preview.png", (series / "preview.png").read_bytes())

    # 5. Manifest last: mixed/ is complete only now.
    annotation = {
        "method": cfg.annotator,
        "encoder": encoder.identity if encoder is not None else None,
        "prototypes": cfg.prototypes if needs_features else None,
        "sharpening": cfg.sharpening,
    }
    if needs_features and cfg.prototypes == "text":
        annotation["text_templates"] = list(cfg.text_templates)
    folder.finish(
        n_shards,
        kind="mixed",
        class_names=class_names,
        upstream=upstream_digests(series, real),
        code_version=code_version(),
        info={**series_m.info, "annotation": annotation},
    )
    log_summary(cfg, stats, fidelity, mixed)
    return mixed
