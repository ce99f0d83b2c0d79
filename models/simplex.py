"""k-way semantic mixing (beyond docs/methods.md §1-2, whose CSM mixes two classes): simplex lattices,
barycentric coordinates, k-way soft targets. Pure tensors and tuples, no file I/O.

A series over the class tuple (c_1, ..., c_k) is one shared noise rendered at every point of the
simplex lattice of resolution m: the weight vectors w with w_i = n_i / m, n_i ≥ 0, Σ n_i = m.
For k = 2 and m = K − 1 the lattice is CSM's α grid (α = w_1, the weight of class a).

Re-annotation generalises the projection of docs/methods.md §2: λ̂ are the barycentric coordinates of
the feature f in the affine hull of the k prototypes,

    λ̂_{1..k−1} = argmin_x ‖(f − p_k) − Σ_{i<k} x_i (p_i − p_k)‖²,   λ̂_k = 1 − Σ_{i<k} λ̂_i,

unclipped (for k = 2 this is ⟨f − p_b, p_a − p_b⟩ / ‖p_a − p_b‖²), and the soft target is
t = softmax((s/2)·λ̂) over the k classes, which for k = 2 is σ(s(λ̂_a − 0.5)).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import combinations, pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from models.annotation_stats import spearman


def lattice_points(k: int, m: int) -> tuple[tuple[int, ...], ...]:
    """All n ∈ N^k with Σ n_i = m, in ascending lexicographic order.

    For k = 2 the order is (0, m), (1, m − 1), ..., (m, 0): position j has α = j/m, today's α
    grid; in general the first point is the pure last class and the last the pure first class.
    """
    if k < 1 or m < 1:
        raise ValueError(f"need k >= 1 classes and lattice m >= 1, got k={k}, m={m}")
    return _compositions(k, m)


def _compositions(k: int, m: int) -> tuple[tuple[int, ...], ...]:
    if k == 1:
        return ((m,),)
    return tuple((n, *rest) for n in range(m + 1) for rest in _compositions(k - 1, m - n))


def lattice_weights(k: int, m: int) -> tuple[tuple[float, ...], ...]:
    """w = n / m for every lattice point (same order as `lattice_points`)."""
    return tuple(tuple(n_i / m for n_i in n) for n in lattice_points(k, m))


def num_lattice_points(k: int, m: int) -> int:
    """C(m + k − 1, k − 1)."""
    return math.comb(m + k - 1, k - 1)


def lattice_edges(points: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int, int]]:
    """(p, q, i, j): points p → q of the lattice that move one unit of weight from class j to
    class i (n_q = n_p + e_i − e_j): the edges along which w_i − w_j rises by 2/m."""
    where = {n: p for p, n in enumerate(points)}
    edges = []
    for p, n in enumerate(points):
        for i in range(len(n)):
            for j in range(len(n)):
                if i != j and n[j] > 0:
                    q = list(n)
                    q[i], q[j] = q[i] + 1, q[j] - 1
                    edges.append((p, where[tuple(q)], i, j))
    return edges


# ---------------------------------------------------------------------------------------------
# class tuples: the k-subsets of the classes, numbered but never listed


def class_tuples(num_classes: int, k: int) -> ClassTuples:
    """Every k-subset c_1 < ... < c_k in lexicographic order (for k = 2: the pairs a < b)."""
    return ClassTuples(num_classes, k)


class ClassTuples(Sequence):
    """The k-subsets c_1 < ... < c_k of range(num_classes) in lexicographic order (k = 2: the
    pairs a < b), or only those numbered by the increasing `ranks`, without listing them.

    Item r is computed from r (`unrank_tuple`), so the 499,500 pairs of 1,000 classes, or their
    166,167,000 triples, take a few bytes until one is used, and a seeded subset takes 8 bytes a
    tuple. Equal to any sequence holding the same tuples in the same order.
    """

    def __init__(self, num_classes: int, k: int, ranks: Sequence[int] | None = None) -> None:
        if num_classes < 0 or k < 1:
            raise ValueError(f"need num_classes >= 0 and k >= 1, got {num_classes}, {k}")
        self.num_classes, self.k = num_classes, k
        self.total = math.comb(num_classes, k)
        self.ranks = None if ranks is None else array("q", ranks)
        if self.ranks is not None and not _increasing_within(self.ranks, self.total):
            raise ValueError(f"ranks must increase and lie in [0, {self.total})")

    def __len__(self) -> int:
        return self.total if self.ranks is None else len(self.ranks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"class tuple {i} of {n}")
        i %= n
        return unrank_tuple(i if self.ranks is None else self.ranks[i], self.num_classes, self.k)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        if self.ranks is None:
            return combinations(range(self.num_classes), self.k)
        return (unrank_tuple(r, self.num_classes, self.k) for r in self.ranks)

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        """Position of a tuple, computed (no search through the sequence)."""
        t = tuple(value)
        if len(t) == self.k and _increasing_within(t, self.num_classes):
            r = rank_tuple(t, self.num_classes)
            i = r if self.ranks is None else bisect_left(self.ranks, r)
            if start <= i < (len(self) if stop is None else stop) and self[i] == t:
                return i
        raise ValueError(f"{value!r} is not among these class tuples")

    def __contains__(self, value) -> bool:
        try:
            self.index(value)
        except (ValueError, TypeError):
            return False
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        if isinstance(other, ClassTuples) and (self.num_classes, self.k, self.ranks) == (
            other.num_classes,
            other.k,
            other.ranks,
        ):
            return True
        return len(self) == len(other) and all(a == tuple(b) for a, b in zip(self, other))

    __hash__ = None  # equal to tuples it cannot share a hash with

    def __repr__(self) -> str:
        which = "all" if self.ranks is None else f"{len(self)} of"
        return f"ClassTuples({which} {self.total} {self.k}-subsets of {self.num_classes} classes)"


def _increasing_within(values: Sequence[int], n: int) -> bool:
    """0 <= values[0] < values[1] < ... < n (True when empty)."""
    ends_ok = not len(values) or (values[0] >= 0 and values[-1] < n)
    return ends_ok and all(x < y for x, y in pairwise(values))


def unrank_tuple(r: int, n: int, k: int) -> tuple[int, ...]:
    """The r-th k-subset c_1 < ... < c_k of range(n) in lexicographic order.

    Among the subsets whose elements are all >= lo, those with first element >= c number
    C(n − c, j) (j = elements still to pick), so c is the largest value with C(n − c, j) >=
    C(n − lo, j) − r: a binary search per element, O(k log n) binomials. k = 2 solves the
    quadratic instead (`_unrank_pair`).
    """
    if not 0 <= r < math.comb(n, k):
        raise IndexError(f"rank {r} outside [0, C({n}, {k}))")
    if k == 2:
        return _unrank_pair(r, n)
    out, lo = [], 0
    for j in range(k, 0, -1):
        total = math.comb(n - lo, j)
        target = total - r
        a, b = lo, n - j
        while a < b:
            mid = (a + b + 1) // 2
            if math.comb(n - mid, j) >= target:
                a = mid
            else:
                b = mid - 1
        r -= total - math.comb(n - a, j)
        out.append(a)
        lo = a + 1
    return tuple(out)


def _unrank_pair(r: int, n: int) -> tuple[int, int]:
    """Pair r = (a, b): the S(a) = a(2n − a − 1)/2 pairs before a's satisfy S(a) <= r < S(a + 1),
    so a is the smaller root of S(a) = r, rounded down (isqrt is exact; one fix-up step)."""
    d = 2 * n - 1
    a = (d - math.isqrt(d * d - 8 * r)) // 2
    while a > 0 and a * (d - a) // 2 > r:
        a -= 1
    while (a + 1) * (d - a - 1) // 2 <= r:
        a += 1
    return a, a + 1 + r - a * (d - a) // 2


def rank_tuple(t: Sequence[int], n: int) -> int:
    """Inverse of `unrank_tuple`: the position of c_1 < ... < c_k among the k-subsets of range(n)."""
    r, lo = 0, 0
    for i, c in enumerate(t):
        j = len(t) - i
        r += math.comb(n - lo, j) - math.comb(n - c, j)
        lo = c + 1
    return r


def barycentric(f: Tensor, p: Tensor) -> Tensor:
    """λ̂ [N, k] float32: barycentric coordinates of f [N, d] in the affine hull of the
    prototypes p [N, k, d] (least squares of f − p_k on p_i − p_k, unclipped; Σ λ̂ = 1).

    Computed in float64 (features share a large common component, so f − p_k cancels) through
    the normal equations of the (k − 1)-dimensional problem. Affinely dependent prototypes
    (the hull has fewer than k − 1 dimensions) have no unique coordinates: ValueError.
    """
    if p.ndim != 3 or f.ndim != 2 or p.shape[0] != f.shape[0] or p.shape[2] != f.shape[1]:
        raise ValueError(f"need f [N, d] and p [N, k, d], got {tuple(f.shape)}, {tuple(p.shape)}")
    f, p = f.double(), p.double()
    last = p[:, -1]
    a = p[:, :-1] - last[:, None]  # [N, k−1, d]
    gram = a @ a.transpose(1, 2)  # [N, k−1, k−1]
    rhs = (a @ (f - last)[:, :, None])[:, :, 0]  # [N, k−1]
    scale = gram.diagonal(dim1=1, dim2=2).amax(dim=1).clamp(min=1e-300)
    det = torch.linalg.det(gram / scale[:, None, None])
    if (det.abs() < 1e-12).any():
        rows = (det.abs() < 1e-12).nonzero().flatten()
        raise ValueError(
            f"affinely dependent prototypes for {rows.numel()} rows (first: {rows[0].item()}); "
            "the barycentric coordinates are undefined"
        )
    x = torch.linalg.solve(gram, rhs)
    return torch.cat([x, 1.0 - x.sum(dim=1, keepdim=True)], dim=1).float()


def softmax_targets(lambda_hat: Tensor, s: float) -> Tensor:
    """t = softmax((s/2)·λ̂) over the k classes [N, k] (k = 2: t_a = σ(s(λ̂_a − 0.5)))."""
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"sharpening s must be a finite number > 0, got {s}")
    return torch.softmax((s / 2) * lambda_hat.float(), dim=-1)


def similarity_shares(f: Tensor, p: Tensor) -> Tensor:
    """t ∝ max(0, cos(f, p_i)) over the k prototypes p [N, k, d] (the `similarity` ablation);
    uniform 1/k where no cosine is positive (no evidence either way)."""
    cos = F.cosine_similarity(f.double()[:, None], p.double(), dim=-1).clamp(min=0)
    total = cos.sum(dim=1, keepdim=True)
    uniform = torch.full_like(cos, 1.0 / cos.shape[1])
    return torch.where(total > 0, cos / total.clamp(min=1e-300), uniform).float()


# ---------------------------------------------------------------------------------------------
# k-way re-annotation (docs/methods.md §2 generalised) and its statistics


def annotate_simplex(
    annotator: str, features: Tensor | None, weights: Tensor, classes: Tensor, prototypes, s: float
) -> tuple[Tensor, Tensor]:
    """-> (λ̂ [N, k], t [N, k]) float32 for images of class tuples `classes` [N, k] generated
    with `weights` [N, k]. projection: barycentric λ̂, t = softmax((s/2)·λ̂); similarity:
    t ∝ positive cosine to the k prototypes, λ̂ := t; ratio: t = λ̂ := w (no re-annotation)."""
    weights, classes = torch.as_tensor(weights), torch.as_tensor(classes).long()
    if weights.ndim != 2 or weights.shape != classes.shape:
        raise ValueError(f"weights and classes must both be [N, k], got {tuple(weights.shape)}, "
                         f"{tuple(classes.shape)}")  # fmt: skip
    if annotator == "ratio":
        return weights.float().clone(), weights.float().clone()
    if features is None or prototypes is None:
        raise ValueError(f"annotator '{annotator}' needs features and prototypes")
    if features.shape[0] != weights.shape[0]:
        raise ValueError(f"{features.shape[0]} features for {weights.shape[0]} images")
    if int(classes.min()) < 0 or int(classes.max()) >= prototypes.shape[0]:
        raise ValueError(f"class ids must lie in [0, {prototypes.shape[0]})")
    p = prototypes.to(features.device)[classes]  # [N, k, d]
    if annotator == "similarity":
        t = similarity_shares(features, p)
        return t.clone(), t
    if annotator != "projection":
        raise ValueError(f"unknown annotator '{annotator}'")
    lam = barycentric(features, p)
    return lam, softmax_targets(lam, s)


def edge_monotone_share(
    lambda_hat: Tensor, series: Tensor, positions: Tensor, points: tuple[tuple[int, ...], ...]
) -> tuple[float | None, int]:
    """Share of complete series whose λ̂ follows w along every lattice edge, and their count.

    Along an edge that moves weight from class j to class i (w_i − w_j rises), λ̂_i − λ̂_j must
    not fall (for k = 2 this is "λ̂_a non-decreasing in α"). Ties count as following.
    """
    edges, n_points = lattice_edges(points), len(points)
    sid, pos = torch.as_tensor(series).long(), torch.as_tensor(positions).long()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= n_points):
        raise ValueError(f"lattice positions must lie in [0, {n_points})")
    # sorted (series, position) keys, not a dict per series: millions of images are a few
    # sorts. A repeated (series, position) counts once (its last image); a series is complete
    # when it holds every lattice point.
    order = torch.argsort(sid * n_points + pos, stable=True)
    key = (sid * n_points + pos)[order]
    last = torch.ones_like(key, dtype=torch.bool)
    last[:-1] = key[1:] != key[:-1]
    key, rows = key[last], order[last]
    _, counts = torch.unique_consecutive(key // n_points, return_counts=True)
    complete = torch.repeat_interleave(counts == n_points, counts)
    if not complete.any():
        return None, 0
    lam = lambda_hat.double()[rows[complete]].reshape(-1, n_points, lambda_hat.shape[1])
    p, q, i, j = torch.tensor(edges, dtype=torch.long).reshape(-1, 4).T
    before = lam[:, p, i] - lam[:, p, j]
    after = lam[:, q, i] - lam[:, q, j]
    follows = (after >= before).all(dim=1)
    return float(follows.double().mean()), lam.shape[0]


def simplex_stats(
    lambda_hat: Tensor,
    weights: Tensor,
    series: Tensor,
    positions: Tensor,
    points: tuple[tuple[int, ...], ...],
) -> dict:
    """JSON-able summary of a k-way annotation: Spearman(w_i, λ̂_i) over all images and
    classes, the edge-monotone share, λ̂ per lattice point (mean, std), λ̂ outside the simplex."""
    lam, w = lambda_hat.double(), weights.double()
    if lam.shape != w.shape or lam.ndim != 2 or lam.shape[0] == 0:
        raise ValueError(f"need λ̂ and w [N, k], got {tuple(lam.shape)}, {tuple(w.shape)}")
    if not torch.isfinite(lam).all():
        raise ValueError("lambda_hat contains non-finite values")
    share, checked = edge_monotone_share(lam, series, positions, points)
    per_point = []
    for p, n in enumerate(points):
        at = lam[positions == p]
        if at.numel():
            per_point.append({
                "weights": [n_i / sum(n) for n_i in n], "n": int(at.shape[0]),
                "mean": at.mean(dim=0).tolist(), "std": at.std(dim=0, correction=0).tolist(),
            })  # fmt: skip
    return {
        "n_images": int(lam.shape[0]),
        "n_series": int(torch.unique(series).numel()),
        "mix_classes": int(lam.shape[1]),
        "lattice_points": len(points),
        "spearman_lambda_weight": spearman(w.flatten(), lam.flatten()),
        "edge_monotone_direction": "along every lattice edge moving weight from class j to "
        "class i, lambda_hat_i - lambda_hat_j does not decrease",
        "edge_monotone_share": share,
        "n_series_checked": checked,
        "lambda_hat": {
            "mean": lam.mean(dim=0).tolist(),
            "min": float(lam.min()),
            "max": float(lam.max()),
            "share_outside_simplex": float((lam < 0).any(dim=1).double().mean()),
        },
        "per_point": per_point,
    }
