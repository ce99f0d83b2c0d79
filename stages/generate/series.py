"""generate, part 3: the series/ folder: the samples of a shard, preview.png and the manifest's
info (docs/architecture.md, "series/").

One sample per (series, position): key s0000042_03, the PNG, `cls` = the dominant generation class
and a `json` whose field set is identical in every sample (so Hugging Face `datasets` infers one
schema); k = 2 keeps the 2-way fields (classes [a, b], alpha), k ≥ 3 writes the weight vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from core.plots import image_grid
from models.generators import SeriesSpec
from shards.reader import iter_shard
from shards.writer import ShardFolder
from stages.configs.generate import Config
from stages.generate.plan import Plan


def _mixing_fields(plan: Plan, spec, k: int, names) -> tuple[dict[str, Any], int]:
    """(json fields naming the mix of position k, the dominant class).

    k = 2 keeps the 2-way fields (classes [a, b], alpha = weight of a); k ≥ 3 writes classes
    and weights of length k. Dominant = highest weight, the first class on ties (α = 0.5: a).
    """
    if plan.k == 2:
        a, b, alpha = spec.class_a, spec.class_b, plan.alphas[k]
        fields = {"classes": [a, b], "names": [names[a], names[b]], "alpha": alpha}
        return fields, (a if alpha >= 0.5 else b)
    w = plan.alphas[k]
    fields = {
        "classes": list(spec.classes),
        "names": [names[c] for c in spec.classes],
        "weights": list(w),
    }
    return fields, spec.classes[max(range(len(w)), key=lambda i: (w[i], -i))]


def sample_key(series: int, position: int, positions: int) -> str:
    """s0000042_03: series id, position (two digits, more when a series has > 100 images)."""
    return f"s{series:07d}_{position:0{max(2, len(str(positions - 1)))}d}"


def shard_samples(
    plan: Plan, specs: Sequence[SeriesSpec], images: torch.Tensor, names, ident: dict
) -> list[dict[str, Any]]:
    """Sample dicts of one shard; the json field set is identical in every sample."""
    generator = f"{ident['backend']}:{ident['model_id']}"
    samples = []
    for spec, series in zip(specs, images.numpy()):
        for k in range(len(plan.alphas)):
            mix, dominant = _mixing_fields(plan, spec, k, names)
            meta = {
                "series": spec.series_id,
                "position": k,
                **mix,
                "seed": spec.seed,
                "generator": generator,
                "revision": ident["revision"],
                "sampler": ident["sampler"],
                "steps": ident["steps"],
                "guidance": ident["guidance"],
            }
            samples.append(
                {
                    "__key__": sample_key(spec.series_id, k, len(plan.alphas)),
                    "png": series[k],
                    "cls": dominant,
                    "json": meta,
                }
            )
    return samples


def write_preview(folder: ShardFolder, plan: Plan, n_series: int) -> None:
    """preview.png from the written shards (rows = series, columns = α), whoever wrote them.

    Rows are series spread over the first pass of the pair walk, so they show different pairs
    rather than (0, 1), (0, 2), ... only.
    """
    k = len(plan.alphas)
    first_pass = min(len(plan.pairs), plan.num_series)
    step = max(1, first_pass // max(n_series, 1))
    wanted = list(range(0, first_pass, step))[:n_series]
    images: dict[int, list[np.ndarray]] = {s: [None] * k for s in wanted}
    names: dict[int, str] = {}
    for shard in sorted({s // plan.series_per_shard for s in wanted}):
        for sample in iter_shard(folder.path(shard)):
            meta = sample["meta"]
            if meta["series"] in images:
                images[meta["series"]][meta["position"]] = sample["image"]
                # reads left to right: α = 0 is pure b (k ≥ 3: position 0 is the last class)
                names[meta["series"]] = ">".join(reversed(meta["names"]))
    wanted = [s for s in wanted if s in names]  # the endpoint check may have dropped some
    if plan.k == 3:
        return write_triangles(
            folder, plan, [images[s] for s in wanted], [names[s] for s in wanted]
        )
    rows = [im for s in wanted for im in images[s]]
    labels = [names[s] for s in wanted]
    n = min(n_series, len(rows) // k)
    if n == 0:
        return
    grid = np.stack(rows[: n * k]).reshape(n, k, *rows[0].shape)
    image_grid(
        grid,
        folder.folder / "preview.png",
        row_labels=labels[:n],
        col_labels=[f"{a:.2f}" for a in plan.alphas] if plan.k == 2 else [],
        scale=max(1, 64 // rows[0].shape[0]),
    )


def write_triangles(folder: ShardFolder, plan: Plan, series: list, names: list[str]) -> None:
    """k = 3 preview: each series as a triangle of its lattice (row i: n_1 = m − i, column j:
    n_3 = j), so the pure classes sit at the corners: c_1 top left, c_2 bottom left, c_3
    bottom right. Series side by side (at most 4), labelled c_3>c_2>c_1 on the left."""
    if not series:
        return
    m = round(1 / min(w for point in plan.alphas for w in point if w > 0))
    where = {tuple(round(w * m) for w in point): p for p, point in enumerate(plan.alphas)}
    series, names = series[:4], names[:4]
    blank = np.full_like(series[0][0], 255)
    grid = np.stack(
        [
            np.stack(
                [
                    s[where[(m - i, i - j, j)]] if j <= i else blank
                    for s in series
                    for j in range(m + 1)
                ]
            )
            for i in range(m + 1)
        ]
    )
    image_grid(
        grid,
        folder.folder / "preview.png",
        row_labels=[" | ".join(names)] + [""] * m,
        scale=max(1, 64 // series[0][0].shape[0]),
    )


def series_info(cfg: Config, plan: Plan, ident: dict[str, Any], image_size: int) -> dict[str, Any]:
    """The manifest's `info`: the generator's identity and the plan; k-way: the lattice instead
    of the α grid (a k = 2 folder keeps the 2-way fields, byte for byte)."""
    if plan.k == 2:
        return {
            "generator": ident,
            "alphas": list(plan.alphas),
            "series_per_pair": cfg.mixing.series_per_pair,
            "num_series": plan.num_series,
            "num_pairs": len(plan.pairs),
            "image_size": image_size,
        }
    return {
        "generator": ident,
        "num_series": plan.num_series,
        "image_size": image_size,
        "mix_classes": plan.k,
        "lattice": cfg.mixing.lattice_m,
        "weights": [list(w) for w in plan.alphas],
        "series_per_tuple": cfg.mixing.budget_per_tuple,
        "num_tuples": len(plan.pairs),
    }
