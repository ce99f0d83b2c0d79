"""CSM re-annotation numerics (docs/methods.md §2), pure tensors: prototypes, λ̂, soft targets, statistics.

For a mixed image of pair (a, b) with unnormalised feature f and class prototypes p_a, p_b:

    λ̂ = ⟨f − p_b, p_a − p_b⟩ / ‖p_a − p_b‖²        (projection on the line through p_b and p_a)
    t_a = σ(s·(λ̂ − 0.5)),  t_b = 1 − t_a             (docs/methods.md §2, training target)

λ̂ and α both measure the share of class a (α = generation weight of a), so a good annotation
rises with α; `annotation_stats` measures exactly that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# 1. Prototypes: per-class mean of unnormalised features of the real training images.


class PrototypeAccumulator:
    """Streaming per-class sum and count, so the stage can fold batches (and ranks) in.

    Sums are float64 on the CPU: the result does not depend on batch order beyond float64
    rounding, and ranks can all-reduce or `merge` `sums`/`counts` before `prototypes()`.
    """

    def __init__(self, num_classes: int, feature_dim: int | None = None) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_classes = num_classes
        self.counts = torch.zeros(num_classes, dtype=torch.int64)
        self.sums: Tensor | None = None
        if feature_dim is not None:
            self.sums = torch.zeros(num_classes, feature_dim, dtype=torch.float64)

    def update(self, features: Tensor, labels: Tensor) -> None:
        features = features.detach().to("cpu", torch.float64)
        labels = torch.as_tensor(labels).to("cpu", torch.int64).reshape(-1)
        if features.ndim != 2 or features.shape[0] != labels.shape[0]:
            raise ValueError(
                f"features [N, d] and labels [N] do not match: "
                f"{tuple(features.shape)} vs {tuple(labels.shape)}"
            )
        if labels.numel() and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got {labels.unique()}")
        if self.sums is None:
            self.sums = torch.zeros(self.num_classes, features.shape[1], dtype=torch.float64)
        if features.shape[1] != self.sums.shape[1]:
            raise ValueError(f"feature dim {features.shape[1]} != {self.sums.shape[1]}")
        self.sums.index_add_(0, labels, features)
        self.counts += torch.bincount(labels, minlength=self.num_classes)

    def merge(self, other: PrototypeAccumulator) -> None:
        if other.sums is None:
            return
        if self.sums is None:
            self.sums = torch.zeros_like(other.sums)
        self.sums += other.sums
        self.counts += other.counts

    def prototypes(self) -> Tensor:
        """[C, d] float32 class means; a class without samples has no prototype: ValueError."""
        empty = (self.counts == 0).nonzero().flatten().tolist()
        if self.sums is None or empty:
            raise ValueError(
                f"classes {empty or list(range(self.num_classes))} have no real samples; every "
                f"class needs at least one image for its prototype (or use text prototypes)"
            )
        return (self.sums / self.counts[:, None]).float()


def class_prototypes(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """Per-class mean of unnormalised features [N, d] -> [C, d] (docs/methods.md §2, prototype p_k)."""
    acc = PrototypeAccumulator(num_classes, features.shape[-1])
    acc.update(features, labels)
    return acc.prototypes()


def text_prototypes(
    encoder: Any,
    class_names: Sequence[str],
    templates: Sequence[str] = ("a photo of a {}.",),
    batch_size: int = 256,
) -> Tensor:
    """Zero-shot prototypes [C, d]: mean over templates of the unnormalised `encode_text` features.

    For users without real images. Text and image features share CLIP's space but not its norms,
    so λ̂ from text prototypes is noisier than from image prototypes. Names are used as given.
    """
    if not class_names or not templates or any("{}" not in t for t in templates):
        raise ValueError("need class names and templates that each contain '{}'")
    prompts = [t.format(name) for name in class_names for t in templates]
    feats = torch.cat(
        [
            encoder.encode_text(prompts[i : i + batch_size])
            for i in range(0, len(prompts), batch_size)
        ]
    )
    return feats.float().view(len(class_names), len(templates), -1).mean(dim=1)


# ---------------------------------------------------------------------------------------------
# 2. λ̂ and soft targets.


def project_lambda(f: Tensor, p_a: Tensor, p_b: Tensor) -> Tensor:
    """λ̂ = ⟨f − p_b, p_a − p_b⟩ / ‖p_a − p_b‖² (docs/methods.md §2), unclipped, float32 [N].

    p_a gives 1, p_b gives 0; points off the line land at their orthogonal projection.
    Computed in float64: CLIP features share a large common component, so f − p_b cancels.
    """
    f, p_a, p_b = torch.broadcast_tensors(f.double(), p_a.double(), p_b.double())
    direction = p_a - p_b
    denom = (direction * direction).sum(dim=-1)
    if (denom == 0).any():
        rows = (denom == 0).nonzero().flatten()
        raise ValueError(
            f"identical prototypes for {rows.numel()} rows (first: {rows[0].item()}); "
            f"the line through p_a and p_b is undefined"
        )
    return (((f - p_b) * direction).sum(dim=-1) / denom).float()


def soft_targets(lambda_hat: Tensor, s: float) -> Tensor:
    """t_a = σ(s·(λ̂ − 0.5)) (docs/methods.md §2); t_b = 1 − t_a. σ is symmetric about λ̂ = 0.5."""
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"sharpening s must be a finite number > 0, got {s}")
    return torch.sigmoid(s * (lambda_hat.float() - 0.5))


def _projection(f: Tensor, alpha: Tensor, p_a: Tensor, p_b: Tensor, s: float) -> tuple:
    lambda_hat = project_lambda(f, p_a, p_b)
    return lambda_hat, soft_targets(lambda_hat, s)


def _similarity(f: Tensor, alpha: Tensor, p_a: Tensor, p_b: Tensor, s: float) -> tuple:
    """Ablation: t ∝ cosine similarity to the two prototypes; λ̂ := t_a (the similarity share).

    A negative cosine counts as zero evidence (clamped), since a negative weight would push t
    outside [0, 1]; if both cosines are <= 0 there is no evidence either way and t_a = 0.5.
    Unsharpened (s unused): docs/methods.md §2 defines this target as the normalised similarity itself.
    """
    w_a = F.cosine_similarity(f.double(), p_a.double(), dim=-1).clamp(min=0)
    w_b = F.cosine_similarity(f.double(), p_b.double(), dim=-1).clamp(min=0)
    total = w_a + w_b
    share = torch.where(total > 0, w_a / total.clamp(min=1e-300), torch.full_like(total, 0.5))
    return share.float(), share.float()


def _ratio(f: Tensor | None, alpha: Tensor, p_a: Tensor | None, p_b: Tensor | None, s: float):
    """Ablation without re-annotation: t_a = α, and λ̂ := α so the stored field stays defined."""
    alpha = alpha.float()
    return alpha.clone(), alpha.clone()


class Annotator(NamedTuple):
    fn: Callable[..., tuple[Tensor, Tensor]]
    needs_features: bool  # False: the stage may skip encoding altogether


ANNOTATORS: dict[str, Annotator] = {
    "projection": Annotator(_projection, True),
    "similarity": Annotator(_similarity, True),
    "ratio": Annotator(_ratio, False),
}


def annotate(
    method: str,
    features: Tensor | None,
    alphas: Tensor,
    class_a: Tensor,
    class_b: Tensor,
    prototypes: Tensor | None,
    s: float,
) -> tuple[Tensor, Tensor]:
    """-> (λ̂ [N], t_a [N]) float32 for mixed images of pairs (class_a, class_b)."""
    if method not in ANNOTATORS:
        raise ValueError(f"unknown annotation method '{method}'; valid: {sorted(ANNOTATORS)}")
    annotator = ANNOTATORS[method]
    alphas = torch.as_tensor(alphas)
    class_a, class_b = torch.as_tensor(class_a).long(), torch.as_tensor(class_b).long()
    if not (alphas.shape == class_a.shape == class_b.shape) or alphas.ndim != 1:
        raise ValueError("alphas, class_a and class_b must all be [N]")
    if (class_a == class_b).any():
        raise ValueError("a mixed image needs two different classes (class_a == class_b found)")
    if not annotator.needs_features:
        return annotator.fn(None, alphas, None, None, s)
    if features is None or prototypes is None:
        raise ValueError(f"method '{method}' needs features and prototypes")
    if features.shape[0] != alphas.shape[0]:
        raise ValueError(f"{features.shape[0]} features for {alphas.shape[0]} images")
    num_classes = prototypes.shape[0]
    if min(class_a.min(), class_b.min()) < 0 or max(class_a.max(), class_b.max()) >= num_classes:
        raise ValueError(f"class ids must lie in [0, {num_classes})")
    p = prototypes.to(features.device)
    return annotator.fn(features, alphas, p[class_a], p[class_b], s)


# ---------------------------------------------------------------------------------------------
# 3. Statistics for annotation.json.

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
