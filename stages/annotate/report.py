"""annotate, part 3: what the annotation looks like: annotation.json, annotation.png (λ̂ vs α,
k-way: λ̂_i vs w_i and ternary.png), the generator's fidelity, and the closing log lines.

The report reads every image's fields, so rank 0 holds them as `Columns` (a few numpy arrays,
40 bytes an image for pairs), converted shard by shard from the json: ImageNet's 3,996,000 images
as per-image dicts would take gigabytes of Python objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from core.io import atomic_write_json
from core.logs import log
from core.plots import scatter, ternary
from core.seeding import make_generator
from models.annotation_stats import annotation_stats, fidelity_stats
from models.simplex import lattice_points, simplex_stats
from shards.reader import iter_folder
from stages.common.fidelity import cnn_judge
from stages.configs.annotate import Config

PLOT_POINTS = 5000


class Columns(NamedTuple):
    """The mixed json fields the report needs, one row per image (shards in order)."""

    lambda_hat: np.ndarray  # float64 [n] (2-way: λ̂ of class a) or [n, k]
    mix: np.ndarray  # float64: α [n] (2-way: generation weight of class a) or weights w [n, k]
    series: np.ndarray  # int64 [n]
    position: np.ndarray  # int64 [n]
    classes: np.ndarray  # int32 [n, 2] or [n, k]

    @property
    def kway(self) -> bool:
        return self.mix.ndim == 2

    @property
    def n_images(self) -> int:
        return len(self.series)


def columns(fields: Sequence[dict]) -> Columns:
    """One shard's mixed json (dicts) -> its columns; the dicts can go right after."""
    mix = "weights" if "weights" in fields[0] else "alpha"
    return Columns(
        np.array([f["lambda_hat"] for f in fields], dtype=np.float64),
        np.array([f[mix] for f in fields], dtype=np.float64),
        np.array([f["series"] for f in fields], dtype=np.int64),
        np.array([f["position"] for f in fields], dtype=np.int64),
        np.array([f["classes"] for f in fields], dtype=np.int32),
    )


def concat_columns(parts: Sequence[Columns]) -> Columns:
    """The columns of shards 0, 1, ... in order, as one."""
    return Columns(*(np.concatenate(cols) for cols in zip(*parts)))


def generator_fidelity(cfg: Config, series: Path, class_names, device) -> dict[str, Any] | None:
    """Does the generator draw each class as that class? A real-only classifier (`fidelity_run`)
    on the pure-class images of every series (α = 1: class a, α = 0: class b), next to the same
    classifier on real/test (models.annotation_stats.fidelity_stats)."""
    if not cfg.judge:
        return None
    judge = cnn_judge(cfg.root, cfg.judge, device, cfg.batch_size, key="judge")
    images, expected = endpoints(series)
    if not len(images):
        return None
    predicted = judge.predict(images)
    return fidelity_stats(predicted, expected, class_names, judge.real_test_accuracy)


def endpoints(series: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-class images of a series (or mixed) folder: uint8 [N, H, W, 3] and the class
    each was generated for (2-way: α = 1 is class a, α = 0 class b; k-way: the vertices)."""
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
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)
    return torch.from_numpy(np.stack(images)), torch.tensor(expected)


def report(
    cfg: Config,
    cols: Columns,
    mixed: Path,
    fidelity: dict | None = None,
    endpoint: dict | None = None,
) -> dict:
    """annotation.json (how λ̂ follows the generation weights, the generator's fidelity and
    generate's endpoint check) and annotation.png (λ̂ vs α; k-way: λ̂_i vs w_i over every class,
    and for k = 3 ternary.png, λ̂ in the simplex triangle)."""
    lam, mix = torch.from_numpy(cols.lambda_hat), torch.from_numpy(cols.mix)
    series = torch.from_numpy(cols.series)
    stats = {"method": cfg.annotator, "sharpening": cfg.sharpening}
    if cols.kway:  # models.simplex.simplex_stats over the lattice the weights lie on
        k = mix.shape[1]
        points = lattice_points(k, round(1 / mix[mix > 0].min().item()))
        stats.update(simplex_stats(lam, mix, series, torch.from_numpy(cols.position), points))
        rho, lead = stats["spearman_lambda_weight"], f", k = {k}: Spearman ρ(w, λ̂) = "
        axes = ("w_i (generation weight of class i)", "λ̂_i (re-annotated weight of i)")
    else:
        stats.update(annotation_stats(lam, mix, series, torch.from_numpy(cols.classes)))
        rho, lead = stats["spearman_lambda_alpha"], ": Spearman ρ = "
        axes = ("α (generation weight of class a)", "λ̂ (re-annotated weight of a)")
    stats["generator_fidelity"] = fidelity
    if endpoint is not None:  # generate's endpoint check: series redrawn or dropped
        stats["endpoint_check"] = endpoint
    atomic_write_json(mixed / "annotation.json", stats)
    # at most PLOT_POINTS points (seeded choice): the picture is the same, the plot stays fast
    keep = torch.randperm(cols.n_images, generator=make_generator(cfg.seed, "annotation-plot"))
    keep = keep[:PLOT_POINTS].sort().values
    title = f"{cfg.annotator}{lead}{rho:.3f}" if rho is not None else cfg.annotator
    scatter(
        mix[keep].flatten(), lam[keep].flatten(), mixed / "annotation.png",
        xlabel=axes[0], ylabel=axes[1], title=title, diagonal=True, jitter=0.01, seed=cfg.seed,
    )  # fmt: skip
    if cols.kway and mix.shape[1] == 3:
        ternary(mix[keep], lam[keep], mixed / "ternary.png", title=title,
                corners=("class 1 (first of the tuple)", "class 2", "class 3"))  # fmt: skip
    return stats


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def log_summary(cfg: Config, stats: dict, fidelity: dict | None, mixed: Path) -> None:
    """The closing lines: how well λ̂ follows the generation weights, and the generator's fidelity."""
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
            fidelity["accuracy"], fidelity["n_images"], cfg.judge,
            fidelity["real_test_accuracy"], worst[0], worst[1]["accuracy"],
        )  # fmt: skip
