"""CSM re-annotation numerics (docs/methods.md §2), pure tensors: prototypes, λ̂, soft targets.

For a mixed image of pair (a, b) with unnormalised feature f and class prototypes p_a, p_b:

    λ̂ = ⟨f − p_b, p_a − p_b⟩ / ‖p_a − p_b‖²        (projection on the line through p_b and p_a)
    t_a = σ(s·(λ̂ − 0.5)),  t_b = 1 − t_a             (docs/methods.md §2, training target)

λ̂ and α both measure the share of class a (α = generation weight of a), so a good annotation
rises with α; models/annotation_stats.py measures exactly that.
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
    annotator: str,
    features: Tensor | None,
    alphas: Tensor,
    class_a: Tensor,
    class_b: Tensor,
    prototypes: Tensor | None,
    s: float,
) -> tuple[Tensor, Tensor]:
    """-> (λ̂ [N], t_a [N]) float32 for mixed images of pairs (class_a, class_b)."""
    if annotator not in ANNOTATORS:
        raise ValueError(f"unknown annotator '{annotator}'; valid: {sorted(ANNOTATORS)}")
    entry = ANNOTATORS[annotator]
    alphas = torch.as_tensor(alphas)
    class_a, class_b = torch.as_tensor(class_a).long(), torch.as_tensor(class_b).long()
    if not (alphas.shape == class_a.shape == class_b.shape) or alphas.ndim != 1:
        raise ValueError("alphas, class_a and class_b must all be [N]")
    if (class_a == class_b).any():
        raise ValueError("a mixed image needs two different classes (class_a == class_b found)")
    if not entry.needs_features:
        return entry.fn(None, alphas, None, None, s)
    if features is None or prototypes is None:
        raise ValueError(f"annotator '{annotator}' needs features and prototypes")
    if features.shape[0] != alphas.shape[0]:
        raise ValueError(f"{features.shape[0]} features for {alphas.shape[0]} images")
    num_classes = prototypes.shape[0]
    if min(class_a.min(), class_b.min()) < 0 or max(class_a.max(), class_b.max()) >= num_classes:
        raise ValueError(f"class ids must lie in [0, {num_classes})")
    p = prototypes.to(features.device)
    return entry.fn(features, alphas, p[class_a], p[class_b], s)
