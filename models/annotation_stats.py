"""What annotation.json reports, pure tensors: how well λ̂ follows the generation weight α (rank
statistics, the share of monotone series, the per-pair table) and the generator's fidelity (a
judge's accuracy on the pure-class images). The annotation itself: models/annotation.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# The per-pair table (a row per pair and α) up to all pairs of 100 classes (CIFAR-100); beyond,
# the spread of the per-pair means (ImageNet's 499,500 pairs: the table would be ~0.5 GB)
PER_PAIR_CAP = 4950


def rankdata(x: Tensor) -> Tensor:
    """1-based ranks, ties get the average of the ranks they span (as scipy.stats.rankdata)."""
    _, inverse, counts = torch.unique(x.double(), return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts  # 0-based first position of each tie group
    return (start + (counts + 1) / 2.0).double()[inverse]


def spearman(x: Tensor, y: Tensor) -> float | None:
    """Spearman's ρ = Pearson correlation of average ranks; None when either side is constant."""
    rx, ry = rankdata(x), rankdata(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = (rx.square().sum() * ry.square().sum()).sqrt()
    return None if denom == 0 else float((rx * ry).sum() / denom)


def _group_mean_std(values: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group rows of `keys` [N, k] (ids): -> (unique keys, ascending, counts, mean, population std).

    A row becomes one int64 (mixed radix, same order): a 1-D unique is ~30x faster than
    unique(dim=0) on ImageNet's 3,996,000 (pair, α) keys.
    """
    code = torch.zeros(len(keys), dtype=torch.int64)
    for column in (keys - keys.min(dim=0).values).T:
        code = code * (int(column.max()) + 1) + column
    _, inverse, counts = torch.unique(code, return_inverse=True, return_counts=True)
    uniq = keys.new_empty((len(counts), keys.shape[1]))
    uniq[inverse] = keys  # every row of a group is its key
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, values)
    mean = sums / counts
    dev2 = torch.zeros_like(sums).index_add_(0, inverse, (values - mean[inverse]).square())
    return uniq, counts, mean, (dev2 / counts).sqrt()


def monotone_share(
    lambda_hat: Tensor, alpha: Tensor, series_ids: Tensor
) -> tuple[float | None, int]:
    """Share of series (≥ 2 members) whose λ̂ is non-decreasing as α increases, and their count.

    Non-decreasing because λ̂ and α both measure the weight of class a. Ties count as monotone.
    """
    by_alpha = torch.argsort(alpha, stable=True)
    order = by_alpha[torch.argsort(series_ids[by_alpha], stable=True)]  # series, then α
    sid, lam = series_ids[order], lambda_hat[order]
    same_series = sid[1:] == sid[:-1]
    broken = torch.unique(sid[1:][same_series & (lam[1:] < lam[:-1])])
    _, sizes = torch.unique(series_ids, return_counts=True)
    checked = int((sizes >= 2).sum())
    return (None if checked == 0 else 1.0 - len(broken) / checked), checked


def per_pair_summary(alpha_idx: Tensor, mean: Tensor, alpha_values: Tensor) -> list[dict]:
    """In place of the per-pair table when there are too many pairs: at each α, how the
    per-pair mean λ̂ (`mean` [G], α index `alpha_idx` [G], a (pair, α) group each) is spread
    over the pairs: min, 5 / 25 / 50 / 75 / 95 % quantiles, max."""
    qs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    rows = []
    for k, value in enumerate(alpha_values.tolist()):
        at = mean[alpha_idx == k]  # never empty: α values come from the images
        q = torch.quantile(at, qs).tolist()
        rows.append({
            "alpha": float(value), "pairs": at.numel(), "min": float(at.min()), "q05": q[0],
            "q25": q[1], "median": q[2], "q75": q[3], "q95": q[4], "max": float(at.max()),
        })  # fmt: skip
    return rows


def annotation_stats(
    lambda_hat: Tensor,
    alpha: Tensor,
    series_ids: Tensor,
    pairs: Tensor,
    per_pair_cap: int | None = PER_PAIR_CAP,
) -> dict[str, Any]:
    """JSON-able summary: Spearman(λ̂, α), monotone share, per-pair and per-α mean/std, counts.

    `pairs` [N, 2] holds (a, b) per image, α the generation weight of a. Stds are population
    (ddof = 0) so a single image gives 0. Floats are plain Python floats; undefined -> None.
    More than `per_pair_cap` pairs (None: no cap): `per_pair_summary` and `per_pair_omitted`
    replace the per-pair table, so the json stays small at any size.
    """
    lam = torch.as_tensor(lambda_hat).detach().cpu().double().reshape(-1)
    alpha = torch.as_tensor(alpha).detach().cpu().double().reshape(-1)
    sid = torch.as_tensor(series_ids).detach().cpu().long().reshape(-1)
    pairs = torch.as_tensor(pairs).detach().cpu().long().reshape(-1, 2)
    n = lam.numel()
    if n == 0 or not (alpha.numel() == sid.numel() == pairs.shape[0] == n):
        raise ValueError(
            f"need N > 0 images with matching fields, got {n}, {alpha.numel()}, "
            f"{sid.numel()}, {pairs.shape[0]}"
        )
    if not torch.isfinite(lam).all():
        raise ValueError("lambda_hat contains non-finite values")
    alpha_values, alpha_idx = torch.unique(alpha, return_inverse=True)

    keys, counts, mean, std = _group_mean_std(lam, torch.cat([pairs, alpha_idx[:, None]], 1))
    n_pairs = 1 + int((keys[1:, :2] != keys[:-1, :2]).any(dim=1).sum())  # keys: ascending
    if per_pair_cap is None or n_pairs <= per_pair_cap:
        table: dict[str, list[dict[str, float | int]]] = {}
        for (a, b, k), c, m, sd in zip(keys.tolist(), counts.tolist(), mean.tolist(), std.tolist()):
            row = {"alpha": float(alpha_values[k]), "n": c, "mean": m, "std": sd}
            table.setdefault(f"{a}-{b}", []).append(row)
        per_pair: dict[str, Any] = {"per_pair": table}
    else:
        per_pair = {
            "per_pair_omitted": {"pairs": n_pairs, "cap": per_pair_cap},
            "per_pair_summary": per_pair_summary(keys[:, 2], mean, alpha_values),
        }
    keys, counts, mean, std = _group_mean_std(lam, alpha_idx[:, None])
    per_alpha = [
        {"alpha": float(alpha_values[k]), "n": c, "mean": m, "std": sd}
        for (k,), c, m, sd in zip(keys.tolist(), counts.tolist(), mean.tolist(), std.tolist())
    ]
    share, checked = monotone_share(lam, alpha, sid)
    endpoints = {}
    for name, value in (("alpha_0", 0.0), ("alpha_1", 1.0)):
        at = lam[alpha == value]
        if at.numel():  # the spread of λ̂ where the generator should have drawn a pure class
            q = torch.quantile(at, torch.tensor([0.05, 0.5, 0.95], dtype=at.dtype)).tolist()
            endpoints[name] = {
                "n": at.numel(),
                "mean": float(at.mean()),
                "std": float(at.std(correction=0)),
                "q05": q[0],
                "median": q[1],
                "q95": q[2],
                "min": float(at.min()),
                "max": float(at.max()),
            }
    return {
        "n_images": n,
        "n_series": int(torch.unique(sid).numel()),
        "n_pairs": n_pairs,
        "n_alphas": int(alpha_values.numel()),
        "spearman_lambda_alpha": spearman(lam, alpha),
        "monotone_direction": "lambda_hat non-decreasing as alpha (weight of class a) increases",
        "monotone_share": share,
        "n_series_checked": checked,
        "lambda_hat": {
            "mean": float(lam.mean()),
            "std": float(lam.std(correction=0)),
            "min": float(lam.min()),
            "max": float(lam.max()),
            "share_below_0": float((lam < 0).double().mean()),
            "share_above_1": float((lam > 1).double().mean()),
        },
        "endpoints": endpoints,
        "per_alpha": per_alpha,
        **per_pair,
    }


def fidelity_stats(
    predicted: Tensor,
    expected: Tensor,
    class_names: tuple[str, ...],
    test_accuracy: float | None = None,
) -> dict[str, Any]:
    """Generator fidelity: the share of pure-class images (series endpoints, α = 0 and 1) that a
    real-only classifier assigns to the class they were generated for, overall and per class
    (with the two classes it most often took a class's images for: ``taken_for``), next to that
    classifier's accuracy on real test images (x100)."""
    predicted = torch.as_tensor(predicted).long().reshape(-1)
    expected = torch.as_tensor(expected).long().reshape(-1)
    if predicted.numel() == 0 or predicted.shape != expected.shape:
        raise ValueError(
            f"need matching non-empty predictions, got {predicted.shape}, {expected.shape}"
        )
    hit = (predicted == expected).double()
    per_class = {}
    for k, name in enumerate(class_names):
        mine = expected == k
        if mine.any():
            per_class[name] = {"n": int(mine.sum()), "accuracy": 100.0 * float(hit[mine].mean())}
            wrong = predicted[mine & (predicted != k)]
            if wrong.numel():  # what the judge saw instead: the two commonest, % of the class
                counts = torch.bincount(wrong, minlength=len(class_names))
                top = torch.argsort(counts, descending=True, stable=True)[:2]
                per_class[name]["taken_for"] = {
                    class_names[int(j)]: 100.0 * int(counts[j]) / int(mine.sum())
                    for j in top
                    if counts[j] > 0
                }
    return {
        "n_images": predicted.numel(),
        "accuracy": 100.0 * float(hit.mean()),
        "real_test_accuracy": test_accuracy,
        "per_class": per_class,
    }
