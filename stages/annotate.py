"""annotate: series/ + real/train -> runs/<classes>/mixed/, the shareable dataset (METHODS §2).

    python -m pipeline annotate --preset digits
    accelerate launch --multi_gpu -m pipeline annotate --preset cifar100

Every mixed image gets λ̂ (its projection on the line through the prototypes of its two classes)
and the soft label t_a = σ(s(λ̂ − 0.5)). Mixed shard i is series shard i with the same keys and
the very same PNG bytes (copied, never re-encoded); only `json` (+ λ̂, soft) and `cls` change.

Each image is encoded exactly once: the real training images once for the prototypes (skipped
when mixed/prototypes.* already hold them for this encoder and this real/train), every series
image once for its λ̂. k-way series (`weights` in their json, generate's mix_classes ≥ 3) get
the barycentric λ̂ and t = softmax((s/2)·λ̂) over their k classes (models/simplex.py). Under N processes rank r writes shards i ≡ r (mod N); rank 0 computes the
prototypes before the others start and writes the report and the manifest after all finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from models.annotation import (
    ANNOTATORS,
    PrototypeAccumulator,
    annotate,
    annotation_stats,
    fidelity_stats,
)
from models.annotation import text_prototypes as encode_text_prototypes
from models.classifiers import classifier_from_config
from models.encoders import (
    HFCLIPEncoder,
    ImageEncoder,
    ModuleFeatureEncoder,
    OpenCLIPEncoder,
    file_sha256,
)
from models.simplex import annotate_simplex, lattice_points, simplex_stats
from models.training import collect_logits
from pipeline.configs.annotate import Config
from pipeline.plots import scatter, ternary
from pipeline.runtime import Processes, code_version, log, make_generator, progress
from shards.datasets import load_real
from shards.io import atomic_write_bytes, atomic_write_json, read_json, tmp_path_for
from shards.manifest import (
    MANIFEST,
    Manifest,
    ShardError,
    ShardRecord,
    check_shard,
    manifest_digest,
    read_manifest,
)
from shards.reader import decode_sample, iter_folder, read_raw_shard
from shards.runs import WEIGHTS, load_model
from shards.writer import DONE_DIR, ShardFolder, completed, write_config

PROTOTYPES = "prototypes.safetensors"
PROTOTYPES_META = "prototypes.json"
PLOT_POINTS = 5000
INPUTS = "inputs.json"  # in .done/: what the completed shards were computed from


# ---------------------------------------------------------------- 1. inputs


def check_inputs(cfg: Config) -> tuple[Path, Manifest, Path | None]:
    """(series folder, its manifest, real/train or None): refuse bad input early,
    on every rank alike, before anything is written."""
    series = Path(cfg.series) if cfg.series else cfg.root / "series"
    series_m = read_manifest(series)
    if series_m.kind != "series":
        raise ShardError(f"{series} holds a '{series_m.kind}' folder, not generated series")
    if series_m.num_samples == 0:
        raise ShardError(f"{series} holds no series (0 samples); rerun generate")
    if cfg.prototypes != "real" or not ANNOTATORS[cfg.method].needs_features:
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


# ---------------------------------------------------------------- 2. encoder


def _classifier_encoder(cfg: Config, **kwargs: Any) -> ImageEncoder:
    """Pooled pre-classifier features of runs/<classes>/train/<encoder_run>/, its own normalisation."""
    folder = cfg.root / "train" / cfg.encoder_run
    try:
        model, meta = load_model(folder, classifier_from_config)
    except ShardError as e:
        raise ShardError(f"encoder_run={cfg.encoder_run}: {e}") from e
    mean, std = meta["normalize"]["mean"], meta["normalize"]["std"]
    size = int(meta["image_size"])
    identity = {
        "run": cfg.encoder_run,
        "arch": meta["arch"],
        "weights_sha256": file_sha256(folder / WEIGHTS),
    }
    return ModuleFeatureEncoder(model, size, mean, std, identity, **kwargs)


def _openclip_encoder(cfg: Config, **kwargs: Any) -> ImageEncoder:
    cache = cfg.encoder_cache or None
    return OpenCLIPEncoder(cfg.encoder_model, cfg.encoder_pretrained, cache_dir=cache, **kwargs)


def _hf_clip_encoder(cfg: Config, **kwargs: Any) -> ImageEncoder:
    encoder = HFCLIPEncoder(cfg.encoder_model, **kwargs)
    if Path(cfg.encoder_model).is_dir():  # the manifest holds no absolute paths
        encoder.identity["name"] = Path(cfg.encoder_model).name
    return encoder


ENCODERS = {
    "classifier": _classifier_encoder,
    "openclip": _openclip_encoder,
    "hf-clip": _hf_clip_encoder,
}


def build_encoder(cfg: Config, device: torch.device) -> ImageEncoder:
    kwargs = dict(device=device, batch_size=cfg.batch_size, precision=cfg.precision)
    return ENCODERS[cfg.encoder](cfg, **kwargs)


# ---------------------------------------------------------------- 3. prototypes


def prototype_key(cfg: Config, encoder: ImageEncoder, class_names, real: Path | None) -> dict:
    """Everything the prototypes depend on: equal key -> the saved ones are reused."""
    return {
        "encoder": encoder.identity,
        "source": cfg.prototypes,
        "class_names": list(class_names),
        "real": manifest_digest(real) if real is not None else None,
        "templates": list(cfg.text_templates) if cfg.prototypes == "text" else None,
    }


def compute_prototypes(cfg: Config, encoder: ImageEncoder, class_names, real: Path | None):
    """[C, d]: class means of the real/train features (METHODS §2), or zero-shot text features."""
    if cfg.prototypes == "text":
        return encode_text_prototypes(encoder, class_names, cfg.text_templates), []
    acc = PrototypeAccumulator(len(class_names))
    n = read_manifest(real).num_samples
    with progress(range(n), total=n, desc="prototypes", unit="img") as bar:
        images, labels = [], []
        for sample in iter_folder(real):
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


# ---------------------------------------------------------------- 4. shards


def load_series_shard(path: Path, rec: ShardRecord) -> tuple[list[dict], list[dict], np.ndarray]:
    """-> (raw samples, their json, images uint8 [n, H, W, 3])."""
    raw = read_raw_shard(path, rec, kind="series")  # size, sha256 and count checked
    if not raw:
        raise ShardError(f"{path} holds no samples; rerun generate")
    decoded = [decode_sample(r) for r in raw]  # refuses foreign members (never unpickles)
    meta = [d.get("meta", {}) for d in decoded]
    mix = "weights" if "weights" in meta[0] else "alpha"  # k-way or 2-way series
    missing = {mix, "classes", "series", "position"} - set(meta[0])
    if missing:
        raise ShardError(f"{path}: series samples lack the fields {sorted(missing)}")
    return raw, meta, np.stack([d["image"] for d in decoded])


def label(cfg: Config, meta: list[dict], images: np.ndarray, encoder, prototypes) -> list[dict]:
    """Series json -> mixed json: + lambda_hat and soft [t_a, t_b] (METHODS §2); k-way series:
    lambda_hat and soft of length k."""
    if "weights" in meta[0]:
        return label_kway(cfg, meta, images, encoder, prototypes)
    alpha = torch.tensor([m["alpha"] for m in meta], dtype=torch.float64)
    pairs = torch.tensor([m["classes"] for m in meta], dtype=torch.int64)
    features = encoder.encode(torch.as_tensor(images)) if encoder is not None else None
    lam, t_a = annotate(
        cfg.method, features, alpha, pairs[:, 0], pairs[:, 1], prototypes, cfg.sharpening
    )
    return [
        {**m, "lambda_hat": lam_i, "soft": [t, 1.0 - t]}
        for m, lam_i, t in zip(meta, lam.tolist(), t_a.tolist())
    ]


def label_kway(cfg: Config, meta: list[dict], images: np.ndarray, encoder, prototypes) -> list:
    weights = torch.tensor([m["weights"] for m in meta], dtype=torch.float64)
    classes = torch.tensor([m["classes"] for m in meta], dtype=torch.int64)
    features = encoder.encode(torch.as_tensor(images)) if encoder is not None else None
    lam, t = annotate_simplex(cfg.method, features, weights, classes, prototypes, cfg.sharpening)
    return [
        {**m, "lambda_hat": lam_i, "soft": t_i}
        for m, lam_i, t_i in zip(meta, lam.tolist(), t.tolist())
    ]


def dominant(f: dict) -> int:
    """cls of a mixed sample: argmax of soft (2-way: a if t_a >= 0.5; first class on ties)."""
    soft = f["soft"]
    if len(soft) == 2:
        return f["classes"][0] if soft[0] >= 0.5 else f["classes"][1]
    return f["classes"][max(range(len(soft)), key=lambda i: (soft[i], -i))]


def mixed_samples(raw: list[dict], fields: list[dict]) -> list[dict]:
    """Mixed samples with the series PNG bytes passed through (never re-encoded)."""
    return [
        {"__key__": r["__key__"], "png": r["png"], "cls": dominant(f), "json": f}
        for r, f in zip(raw, fields)
    ]


def _as_is(item):
    return item


class SeriesShards(torch.utils.data.Dataset):
    """Item n = (shard index, raw samples, json, images) of the n-th shard to annotate."""

    def __init__(self, series: Path, shards: dict[int, ShardRecord]):
        self.series, self.shards = series, list(shards.items())

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, n: int):
        i, rec = self.shards[n]
        return (i, *load_series_shard(self.series / rec.name, rec))


def annotate_shards(cfg, shards, series: Path, folder: ShardFolder, encoder, prototypes, bar):
    """Annotate series shards {index: record} in order -> {index: mixed json list}.

    With `workers` > 0, worker processes read and decode the next shards while this process
    encodes and writes (processes, not threads: tar parsing is Python code that holds the GIL,
    which the encoder's torch ops need between kernels). Each shard is computed alone, so its
    bytes depend on neither workers, rank nor resume point.
    """
    out: dict[int, list[dict]] = {}
    # collate_fn=_as_is: the default would walk every nested list converting numpy -> torch
    loader = torch.utils.data.DataLoader(
        SeriesShards(series, shards), batch_size=None, num_workers=cfg.workers, collate_fn=_as_is
    )
    for i, raw, meta, images in loader:
        out[i] = label(cfg, meta, images, encoder, prototypes)
        folder.write(i, mixed_samples(raw, out[i]))
        bar.update(len(raw))
    return out


def generator_fidelity(cfg: Config, series: Path, class_names, device) -> dict[str, Any] | None:
    """Does the generator draw each class as that class? A real-only classifier (`fidelity_run`)
    on the pure-class images of every series (α = 1: class a, α = 0: class b), next to the same
    classifier on real/test (models.annotation.fidelity_stats)."""
    if not cfg.fidelity_run:
        return None
    folder = cfg.root / "train" / cfg.fidelity_run
    try:
        model, meta = load_model(folder, classifier_from_config)  # on the CPU, then moved
    except ShardError as e:
        raise ShardError(f"fidelity_run={cfg.fidelity_run}: {e}") from e
    model = model.to(device)
    images, expected = [], []
    for s in iter_folder(series):
        fields = s["meta"]
        if "weights" in fields:  # k-way: the lattice vertices
            if 1.0 in fields["weights"]:
                images.append(s["image"])
                expected.append(fields["classes"][fields["weights"].index(1.0)])
            continue
        alpha, (a, b) = fields["alpha"], fields["classes"][:2]
        if alpha in (0.0, 1.0):
            images.append(s["image"])
            expected.append(a if alpha == 1.0 else b)
    if not images:
        return None

    def predict(x: torch.Tensor) -> torch.Tensor:
        norm = meta["normalize"]
        logits = collect_logits(
            model, x, norm["mean"], norm["std"], batch_size=cfg.batch_size, device=device,
            image_size=int(meta["image_size"]),
        )  # fmt: skip
        return logits.argmax(dim=1)

    test = load_real(cfg.root / "real" / "test")
    test_acc = 100.0 * float((predict(test.images) == test.labels).double().mean())
    return fidelity_stats(
        predict(torch.from_numpy(np.stack(images))), torch.tensor(expected), class_names, test_acc
    )


def report(cfg: Config, fields: list[dict], mixed: Path, fidelity: dict | None = None) -> dict:
    """annotation.json (models.annotation.annotation_stats + generator fidelity) and
    annotation.png (λ̂ vs α); k-way: report_kway."""
    if "weights" in fields[0]:
        return report_kway(cfg, fields, mixed, fidelity)
    lam = torch.tensor([f["lambda_hat"] for f in fields], dtype=torch.float64)
    alpha = torch.tensor([f["alpha"] for f in fields], dtype=torch.float64)
    series = torch.tensor([f["series"] for f in fields])
    pairs = torch.tensor([f["classes"] for f in fields])
    stats = {"method": cfg.method, "sharpening": cfg.sharpening}
    stats.update(annotation_stats(lam, alpha, series, pairs))
    stats["generator_fidelity"] = fidelity
    atomic_write_json(mixed / "annotation.json", stats)
    # at most PLOT_POINTS points (seeded choice): the picture is the same, the plot stays fast
    keep = torch.randperm(len(fields), generator=make_generator(cfg.seed, "annotation-plot"))
    keep = keep[:PLOT_POINTS].sort().values
    rho = stats["spearman_lambda_alpha"]
    scatter(
        alpha[keep],
        lam[keep],
        mixed / "annotation.png",
        xlabel="α (generation weight of class a)",
        ylabel="λ̂ (re-annotated weight of a)",
        title=f"{cfg.method}: Spearman ρ = {rho:.3f}" if rho is not None else cfg.method,
        diagonal=True,
        jitter=0.01,
        seed=cfg.seed,
    )
    return stats


def report_kway(cfg: Config, fields: list[dict], mixed: Path, fidelity: dict | None) -> dict:
    """annotation.json (models.simplex.simplex_stats + generator fidelity), annotation.png
    (λ̂_i vs w_i over every class) and, for k = 3, ternary.png (λ̂ in the simplex triangle)."""
    lam = torch.tensor([f["lambda_hat"] for f in fields], dtype=torch.float64)
    w = torch.tensor([f["weights"] for f in fields], dtype=torch.float64)
    k = w.shape[1]
    m = round(1 / w[w > 0].min().item())
    points = lattice_points(k, m)
    series = torch.tensor([f["series"] for f in fields])
    positions = torch.tensor([f["position"] for f in fields])
    stats = {"method": cfg.method, "sharpening": cfg.sharpening}
    stats.update(simplex_stats(lam, w, series, positions, points))
    stats["generator_fidelity"] = fidelity
    atomic_write_json(mixed / "annotation.json", stats)
    keep = torch.randperm(len(fields), generator=make_generator(cfg.seed, "annotation-plot"))
    keep = keep[:PLOT_POINTS].sort().values
    rho = stats["spearman_lambda_weight"]
    title = (
        f"{cfg.method}, k = {k}: Spearman ρ(w, λ̂) = {rho:.3f}" if rho is not None else cfg.method
    )
    scatter(
        w[keep].flatten(), lam[keep].flatten(), mixed / "annotation.png",
        xlabel="w_i (generation weight of class i)", ylabel="λ̂_i (re-annotated weight of i)",
        title=title, diagonal=True, jitter=0.01, seed=cfg.seed,
    )  # fmt: skip
    if k == 3:
        ternary(w[keep], lam[keep], mixed / "ternary.png", title=title,
                corners=("class 1 (first of the tuple)", "class 2", "class 3"))  # fmt: skip
    return stats


# ---------------------------------------------------------------- the stage


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def already_complete(cfg: Config, mixed: Path, series: Path, real: Path | None, encoder) -> bool:
    """mixed/ is complete for this config, these upstream folders and this encoder: a rerun
    only reads (it also works on read-only media)."""
    upstream = {"series": manifest_digest(series)}
    if real is not None:
        upstream["real"] = manifest_digest(real)
    if not completed(mixed, cfg.to_dict(), upstream):
        return False
    done = read_manifest(mixed).info.get("annotation", {}).get("encoder")
    if encoder is not None and done != json.loads(json.dumps(encoder.identity)):
        return False  # e.g. a retrained encoder run under the same name: annotate again
    log.info("annotate: %s is complete already", mixed)
    return True


def run(cfg: Config) -> Path:
    # 1. Check inputs (every rank, before anything is written or waited for).
    series, series_m, real = check_inputs(cfg)
    # accelerate sees torchrun's ranks on a CPU-only machine only when asked for the CPU
    procs = Processes(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    mixed = cfg.root / "mixed"
    class_names = series_m.class_names
    needs_features = ANNOTATORS[cfg.method].needs_features
    device = torch.device(cfg.device) if cfg.device else procs.device
    encoder = build_encoder(cfg, device) if needs_features else None
    if already_complete(cfg, mixed, series, real, encoder):
        return mixed
    if procs.is_main or (mixed / "config.json").is_file():
        write_config(mixed, cfg.to_dict())  # other ranks only compare (rank 0 writes)
    folder = ShardFolder(mixed, prefix="mixed")
    n_shards = len(series_m.shards)
    log.info(
        "annotate %s: %d images in %d shards, method %s, encoder %s, %d process(es) -> %s",
        series,
        series_m.num_samples,
        n_shards,
        cfg.method,
        cfg.encoder,
        procs.world,
        mixed,
    )

    # 2. Prototypes: rank 0 computes (or reuses) them; everyone loads the saved tensor.
    if procs.is_main:
        if needs_features:
            ensure_prototypes(cfg, encoder, class_names, real, mixed)
        inputs = {
            "series": manifest_digest(series),
            "prototypes": file_sha256(mixed / PROTOTYPES) if needs_features else None,
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
        fields = annotate_shards(cfg, todo, series, folder, encoder, prototypes, bar)
    procs.barrier()
    if not procs.is_main:
        return mixed

    # 4. Report (rank 0): json of shards it did not annotate itself is read back from mixed/.
    for i in range(n_shards):
        if i not in fields:
            rec = folder.done(i)
            if rec is None:
                raise ShardError(f"{folder.path(i)} is not complete after all ranks finished")
            check_shard(folder.path(i), rec)
            fields[i] = [json.loads(r["json"]) for r in read_raw_shard(folder.path(i))]
    fidelity = generator_fidelity(cfg, series, class_names, device)
    stats = report(cfg, [f for i in range(n_shards) for f in fields[i]], mixed, fidelity)
    if (series / "preview.png").is_file():
        atomic_write_bytes(mixed / "preview.png", (series / "preview.png").read_bytes())

    # 5. Manifest last: mixed/ is complete only now.
    annotation = {
        "method": cfg.method,
        "encoder": encoder.identity if encoder is not None else None,
        "prototypes": cfg.prototypes if needs_features else None,
        "sharpening": cfg.sharpening,
    }
    if needs_features and cfg.prototypes == "text":
        annotation["text_templates"] = list(cfg.text_templates)
    upstream = {"series": manifest_digest(series)}
    if real is not None:
        upstream["real"] = manifest_digest(real)
    folder.finish(
        n_shards,
        kind="mixed",
        class_names=class_names,
        upstream=upstream,
        code_version=code_version(),
        info={**series_m.info, "annotation": annotation},
    )
    kway = "mix_classes" in stats
    log.info(
        "annotate: %d images, Spearman(%s) = %s, %s = %s -> %s",
        stats["n_images"],
        f"w, λ̂ over {stats['mix_classes']} classes" if kway else "λ̂, α",
        _fmt(stats["spearman_lambda_weight" if kway else "spearman_lambda_alpha"]),
        "share of series following w on every lattice edge" if kway else "monotone series share",
        _fmt(stats["edge_monotone_share" if kway else "monotone_share"]),
        mixed,
    )
    if kway and (mixed / "ternary.png").is_file():
        log.info("annotate: ternary plot (w vs λ̂) -> %s", mixed / "ternary.png")
    for name, end in stats.get("endpoints", {}).items():
        log.info(
            "annotate: λ̂ at %s: mean %.3f, 5-95 %% [%.3f, %.3f], min %.3f, max %.3f",
            name.replace("_", " = "), end["mean"], end["q05"], end["q95"], end["min"], end["max"],
        )  # fmt: skip
    if fidelity is not None:
        worst = min(fidelity["per_class"].items(), key=lambda kv: kv[1]["accuracy"])
        log.info(
            "annotate: generator fidelity %.1f %% of %d endpoint images classified as their class "
            "by %s (its real test accuracy: %.1f %%); worst class %s %.1f %%",
            fidelity["accuracy"], fidelity["n_images"], cfg.fidelity_run,
            fidelity["real_test_accuracy"], worst[0], worst[1]["accuracy"],
        )  # fmt: skip
    return mixed
