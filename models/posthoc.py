"""Post-hoc calibrators, fitted on validation logits only, and the choice of the best one
(docs/evaluate.md, "Post-hoc calibrators").

Every calibrator has `fit(val_logits, val_labels) -> self` and `probs(logits) -> p [N, C]`
(float64, rows summing to 1); POSTHOC is the registry name -> class. The three parametric ones
act on x = log softmax(s), which does not depend on the logits' arbitrary per-sample offset
(so they apply as they are to an ensemble's log mean softmax), and return softmax(z(x)):

    temperature  z = x / T                 T minimises the val NLL (fit_temperature_nll)
    vector       z = w ⊙ x + b             Guo et al. 2017 (they scale the raw logits s: for a
                                           network's logits x = s − logsumexp(s), so the two
                                           differ by −logsumexp(s)·w, zero when w is constant)
    dirichlet    z = W x + b, + ODIR       Kull et al. 2019, Dirichlet calibration with the
                 λ/(C(C−1))·Σ_{i≠j} W_ij² + μ/C·Σ_j b_j²   (off-diagonal and intercept penalty)

fitted by minimising the mean val NLL (+ the penalty) with L-BFGS (strong Wolfe line search) in
float64 from the identity (w = 1, W = I, b = 0): no random draw, so a fit is deterministic.
L-BFGS stops at a gradient below 1e-7 or after LBFGS_ITERATIONS = 300 iterations; C ≤ 10
converges well before, while the C² weights of dirichlet for C = 100 reach the cap (the fit is
then stopped early, still deterministically).
The two non-parametric ones calibrate each class's probability p_k one-vs-rest on the 0/1
targets 1[y = k] and renormalise the C outputs (a row of zeros becomes uniform):

    histogram    15 equal-width bins ((m−1)/15, m/15] of p_k, each mapped to the frequency of
                 y = k among the val samples in it (an empty bin: its centre); Zadrozny & Elkan
                 2001
    isotonic     the non-decreasing fit of 1[y = k] on p_k (pool adjacent violators; p_k equal
                 to 1e-15 pooled first), interpolated linearly between the fitted points and
                 constant beyond them, as sklearn's IsotonicRegression(out_of_bounds="clip");
                 Zadrozny & Elkan 2002

Their probabilities may be exactly 0, so every NLL here is `calibration.nll_of_probs` (p_y
floored at float64's epsilon). `fit_posthoc` fits every calibrator and picks the one with the
lowest val NLL, cross-validated: K stratified folds of val (round robin within each class, in
index order, no random draw), each held-out fold scored by the calibrator fitted on the other
K − 1. An in-sample val NLL would favour the flexible methods (isotonic regression fitted and
scored on the same samples is close to a lookup table); ties go to the earlier registry entry.
The calibrators of the result are refitted on all of val.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.nn import functional as F

from models import lbfgs
from models.calibration import N_BINS, NLL_FLOOR, fit_temperature_nll

CV_FOLDS = 5
CRITERION = f"val NLL, {CV_FOLDS}-fold cross-validated (stratified round robin)"
ODIR_LAMBDA = 0.1  # GUESS: Kull et al. choose both on a grid by cross-validation
ODIR_MU = 0.1
LBFGS_ITERATIONS = 300  # a cap: many classes (C = 100) stop here, see docs/evaluate.md
TIE = 1e-15  # sklearn's isotonic regression pools inputs closer than float64's resolution


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.detach().to("cpu", torch.float64), dim=1)


def _labels(labels: torch.Tensor) -> torch.Tensor:
    return labels.detach().cpu().long()


def _cross_entropy(z: np.ndarray, hit: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean −log softmax(z)_y, its gradient in z): F.cross_entropy and its backward in closed
    form, (softmax(z) − onehot(y)) / N. z is class-major [C, N] (a sum over classes is then a
    sum of C rows, several times faster in numpy than C columns), `hit` the flat positions
    y_i·N + i of the labels (`_hits`). z is overwritten by the gradient: the objectives make it
    fresh for each call, and working in place spares three [C, N] arrays per call, each fresh
    memory from the system at these sizes (the same operations, so the same numbers)."""
    n = z.shape[1]
    m = z.max(axis=0)
    label = np.mean(z.ravel()[hit])
    e = np.exp(np.subtract(z, m, out=z), out=z)
    total = e.sum(axis=0)
    loss = float(np.mean(m + np.log(total)) - label)
    e /= total
    e.ravel()[hit] -= 1.0
    e /= n
    return loss, e


def _hits(y: np.ndarray) -> np.ndarray:
    return y * y.size + np.arange(y.size)


def _minimise(objective: lbfgs.Objective, theta: np.ndarray) -> np.ndarray:
    """L-BFGS (strong Wolfe, float64) until the gradient is ~0, at most LBFGS_ITERATIONS
    iterations and 5/4 as many objective evaluations: torch.optim.LBFGS's iterates, without
    its per-operation overhead (models/lbfgs.py)."""
    return lbfgs.minimise(
        objective,
        theta,
        max_iter=LBFGS_ITERATIONS,
        tolerance_grad=1e-7,
        tolerance_change=1e-12,
        history_size=20,
    )


def _renormalise(q: torch.Tensor) -> torch.Tensor:
    total = q.sum(dim=1, keepdim=True)
    uniform = torch.full_like(q, 1.0 / q.shape[1])
    return torch.where(total > 0, q / total.clamp_min(1e-300), uniform)


class Temperature:
    """softmax(x / T), T minimising the val NLL (Guo et al. 2017)."""

    def __init__(self) -> None:
        self.t = 1.0

    def fit(self, logits: torch.Tensor, labels: torch.Tensor) -> Temperature:
        self.t = fit_temperature_nll(logits, labels)
        return self

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.softmax(_log_probs(logits) / self.t, dim=1)


class VectorScaling:
    """softmax(w ⊙ x + b): a scale and a bias per class, unregularised."""

    def __init__(self) -> None:
        self.w: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    def fit(self, logits: torch.Tensor, labels: torch.Tensor) -> VectorScaling:
        x = np.ascontiguousarray(_log_probs(logits).numpy().T)  # [C, N], see _cross_entropy
        hit, c = _hits(_labels(labels).numpy()), x.shape[0]

        def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
            w, b = theta[:c], theta[c:]
            z = x * w[:, None]
            z += b[:, None]
            loss, dz = _cross_entropy(z, hit)
            return loss, np.concatenate([(dz * x).sum(axis=1), dz.sum(axis=1)])

        theta = _minimise(objective, np.concatenate([np.ones(c), np.zeros(c)]))  # w = 1, b = 0
        self.w, self.b = torch.from_numpy(theta[:c].copy()), torch.from_numpy(theta[c:].copy())
        return self

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.softmax(_log_probs(logits) * self.w + self.b, dim=1)


class DirichletScaling:
    """softmax(W x + b) with the ODIR penalty (Kull et al. 2019): the NLL plus
    λ/(C(C−1))·Σ_{i≠j} W_ij² + μ/C·Σ_j b_j²; the diagonal is free."""

    def __init__(self, lam: float = ODIR_LAMBDA, mu: float = ODIR_MU) -> None:
        self.lam, self.mu = lam, mu
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def fit(self, logits: torch.Tensor, labels: torch.Tensor) -> DirichletScaling:
        x = np.ascontiguousarray(_log_probs(logits).numpy().T)  # [C, N], see _cross_entropy
        hit, c = _hits(_labels(labels).numpy()), x.shape[0]
        off = 1.0 - np.eye(c)
        scale = self.lam / max(c * (c - 1), 1)

        def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
            weight, bias = theta[: c * c].reshape(c, c), theta[c * c :]
            z = weight @ x
            z += bias[:, None]
            loss, dz = _cross_entropy(z, hit)
            w_off = weight * off
            loss += scale * float((w_off**2).sum()) + self.mu * float((bias**2).mean())
            d_weight = dz @ x.T + 2.0 * scale * w_off
            d_bias = dz.sum(axis=1) + (2.0 * self.mu / c) * bias
            return loss, np.concatenate([d_weight.ravel(), d_bias])

        theta = _minimise(objective, np.concatenate([np.eye(c).ravel(), np.zeros(c)]))  # W = I
        self.weight = torch.from_numpy(theta[: c * c].reshape(c, c).copy())
        self.bias = torch.from_numpy(theta[c * c :].copy())
        return self

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.softmax(_log_probs(logits) @ self.weight.T + self.bias, dim=1)


class HistogramBinning:
    """One-vs-rest histogram binning on N_BINS equal-width bins of each p_k, renormalised."""

    def __init__(self, n_bins: int = N_BINS) -> None:
        self.n_bins = n_bins
        self.values: torch.Tensor | None = None  # [C, n_bins]

    def _bins(self, p: torch.Tensor) -> torch.Tensor:
        inner = torch.linspace(0.0, 1.0, self.n_bins + 1, dtype=torch.float64)[1:-1]
        return torch.bucketize(p, inner, right=False)  # right-closed, as ECE's bins

    def fit(self, logits: torch.Tensor, labels: torch.Tensor) -> HistogramBinning:
        p = _log_probs(logits).exp()
        c = p.shape[1]
        idx = self._bins(p) + torch.arange(c) * self.n_bins  # [N, C]: class k's bins at k·n_bins
        hit = F.one_hot(_labels(labels), c).to(torch.float64)
        count = torch.bincount(idx.flatten(), minlength=c * self.n_bins).to(torch.float64)
        freq = torch.bincount(idx.flatten(), weights=hit.flatten(), minlength=c * self.n_bins)
        centre = (torch.arange(self.n_bins, dtype=torch.float64) + 0.5) / self.n_bins
        self.values = torch.where(count > 0, freq / count.clamp_min(1), centre.repeat(c)).view(
            c, self.n_bins
        )
        return self

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = _log_probs(logits).exp()
        q = self.values.T.gather(0, self._bins(p))  # q_ik = values[k, bin(p_ik)]
        return _renormalise(q)


def _knot_starts(xs: np.ndarray) -> np.ndarray:
    """Where the knots start in sorted xs: x starts one when it is TIE or more above the first x
    of the current knot (sklearn's rule). A gap of TIE or more always starts one; only a run of
    smaller gaps that spans TIE or more needs the rule walked in order (rare: neighbours a few
    ulps apart), so the walk is over those runs alone."""
    start = np.concatenate([[True], np.diff(xs) >= TIE])
    first = np.flatnonzero(start)
    last = np.append(first[1:], xs.size) - 1
    wide = xs[last] - xs[first] >= TIE
    for a, b in zip(first[wide], last[wide]):
        knot = xs[a]
        for i in range(a + 1, b + 1):
            if xs[i] - knot >= TIE:
                start[i], knot = True, xs[i]
    return start


def isotonic_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(knots, values): the non-decreasing least-squares fit of y on x at the distinct x (runs
    closer than TIE pooled first, keeping their smallest x, y averaged), by pool adjacent
    violators.

    Pooled in vectorised passes rather than one knot at a time: each pass pools every run of
    adjacent blocks whose means do not increase (a violating pair is equal in the solution, and
    so is an equal pair: moving both to their common target lowers the squared error), until
    the means increase strictly. The fit is unique, so any order of valid pools reaches it;
    for 0/1 targets sorted by a classifier's p_k the runs are long and the passes few.
    """
    # 1. Sort, and pool the inputs closer than TIE into knots.
    xs_t, order = torch.sort(x.detach().to("cpu", torch.float64), stable=True)
    xs, ys = xs_t.numpy(), y.detach().to("cpu", torch.float64)[order].numpy()
    first = np.flatnonzero(_knot_starts(xs))
    sums, weights = np.add.reduceat(ys, first), np.diff(np.append(first, xs.size)).astype(float)
    knots = np.ones(first.size, dtype=np.int64)  # knots per block
    # 2. Pool the non-increasing runs of block means until they increase strictly.
    while True:
        means = sums / weights
        rises = means[1:] > means[:-1]
        if rises.all():
            break
        heads = np.flatnonzero(np.concatenate([[True], rises]))
        sums, weights = np.add.reduceat(sums, heads), np.add.reduceat(weights, heads)
        knots = np.add.reduceat(knots, heads)
    values = np.repeat(means, knots)
    return torch.from_numpy(xs[first].copy()), torch.from_numpy(values)


def isotonic_predict(knots: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The fit at x: linear between knots, constant beyond the first and the last."""
    if knots.numel() == 1:
        return values.expand_as(x).clone()
    x = x.clamp(float(knots[0]), float(knots[-1]))
    i = torch.searchsorted(knots, x, right=True).clamp(1, knots.numel() - 1)
    lo, hi = knots[i - 1], knots[i]
    frac = (x - lo) / (hi - lo)
    return values[i - 1] + frac * (values[i] - values[i - 1])


class IsotonicRegression:
    """One-vs-rest isotonic regression of 1[y = k] on p_k, renormalised."""

    def __init__(self) -> None:
        self.fits: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fit(self, logits: torch.Tensor, labels: torch.Tensor) -> IsotonicRegression:
        p, y = _log_probs(logits).exp(), _labels(labels)
        self.fits = [isotonic_fit(p[:, k], (y == k).to(torch.float64)) for k in range(p.shape[1])]
        return self

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = _log_probs(logits).exp()
        q = torch.stack([isotonic_predict(*f, p[:, k]) for k, f in enumerate(self.fits)], dim=1)
        return _renormalise(q)


Calibrator = Temperature | VectorScaling | DirichletScaling | HistogramBinning | IsotonicRegression
POSTHOC: dict[str, type[Calibrator]] = {
    "temperature": Temperature,
    "vector": VectorScaling,
    "dirichlet": DirichletScaling,
    "histogram": HistogramBinning,
    "isotonic": IsotonicRegression,
}


def cv_folds(labels: torch.Tensor, k: int = CV_FOLDS) -> torch.Tensor:
    """Fold of every sample: within each class, samples in index order get folds 0, 1, ..,
    k − 1, 0, 1, ... (stratified, deterministic)."""
    y = _labels(labels)
    order = torch.argsort(y, stable=True)
    first = torch.searchsorted(y[order], y[order], right=False)  # where each class starts
    fold = torch.empty_like(y)
    fold[order] = (torch.arange(y.numel()) - first) % k
    return fold


def cross_validated_nll(
    name: str, logits: torch.Tensor, labels: torch.Tensor, k: int = CV_FOLDS
) -> float:
    """Mean held-out NLL of POSTHOC[name] over the k folds of `cv_folds` (each sample scored
    once, by the calibrator fitted on the folds it is not in)."""
    y = _labels(labels)
    fold = cv_folds(y, k)
    p_y = torch.empty(y.numel(), dtype=torch.float64)
    for f in fold.unique().tolist():
        held = fold == f
        calibrator = POSTHOC[name]().fit(logits[~held], y[~held])
        p_y[held] = calibrator.probs(logits[held]).gather(1, y[held][:, None]).squeeze(1)
    return float(-p_y.clamp_min(NLL_FLOOR).log().mean())  # = calibration.nll_of_probs


@dataclasses.dataclass(frozen=True)
class PosthocFit:
    """Every calibrator fitted on all of val, their cross-validated val NLLs, the best name."""

    calibrators: dict[str, Calibrator]
    val_nll: dict[str, float]
    best: str

    def probs(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: calibrated probabilities of `logits`} for every calibrator."""
        return {name: c.probs(logits) for name, c in self.calibrators.items()}


def fit_posthoc(
    val_logits: torch.Tensor, val_labels: torch.Tensor, k: int = CV_FOLDS
) -> PosthocFit:
    """Fit every calibrator of POSTHOC on val; the best has the lowest `cross_validated_nll`."""
    logits = val_logits.detach().to("cpu", torch.float64)
    y = _labels(val_labels)
    if y.numel() < 2 * k:
        raise ValueError(f"post-hoc calibration needs >= {2 * k} val samples, got {y.numel()}")
    val_nll = {name: cross_validated_nll(name, logits, y, k) for name in POSTHOC}
    best = min(val_nll, key=val_nll.__getitem__)  # min keeps the first of equal values
    calibrators = {name: cls().fit(logits, y) for name, cls in POSTHOC.items()}
    return PosthocFit(calibrators, val_nll, best)
