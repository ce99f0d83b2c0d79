"""Calibration and accuracy metrics, temperature scaling, ensembles (docs/evaluate.md).

Inputs are torch tensors: logits [N, C] (any dtype/device) or probabilities [N, C], and integer
labels [N]. Everything is computed in float64 on the CPU (metrics run once per evaluation;
exactness beats speed here). The single-metric functions take logits and return fractions in
[0, 1] as Python floats; the two report functions, `calibration_metrics` (logits) and
`probability_metrics` (probabilities, e.g. a post-hoc calibrator's output: models/posthoc.py),
return dicts scaled x100 where the quantity is a percentage (each docstring lists which).
Selective classification lives in models/selective.py, smooth ECE in models/smooth_ece.py and
OOD detection in models/ood.py.

Binning: 15 equal-width bins, bin m = ((m-1)/15, m/15]; a confidence of exactly 0 falls into the
first bin. torchmetrics uses [lo, hi) bins instead, which only differs for confidences exactly on
an edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn import functional as F

from models.selective import augrc, aurc, risk_at_coverage
from models.smooth_ece import smooth_ece

N_BINS = 15
# NLL of probabilities: p_y is floored at float64's epsilon (sklearn's log_loss clips the same),
# so a calibrator that gives the label probability 0 costs 36 nats, not infinity.
NLL_FLOOR = float(torch.finfo(torch.float64).eps)
PERCENT_KEYS = (
    *("top1", "top5", "ece", "aece", "mce", "oece", "uece", "classwise_ece"),
    *("smece", "debiased_ece", "l2_ece", "classwise_l2_ece", "aurc", "augrc", "risk_at_80"),
)  # the keys of the report functions given x100 ...
METRIC_KEYS = (*PERCENT_KEYS, "nll", "brier", "n")  # ... and all of them, in report order


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return F.softmax(logits.detach().to("cpu", torch.float64), dim=1)


def _conf_correct(p: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, y_hat = p.max(dim=1)
    return c, (y_hat == labels.detach().cpu()).to(torch.float64)


def _onehot(labels: torch.Tensor, classes: int) -> torch.Tensor:
    return F.one_hot(labels.detach().cpu().long(), classes).to(torch.float64)


def _bin_index(values: torch.Tensor, inner_edges: torch.Tensor) -> torch.Tensor:
    # bucketize(right=False) returns i with edges[i-1] < v <= edges[i]: right-closed bins.
    return torch.bucketize(values, inner_edges, right=False)


def _equal_width_inner_edges(n_bins: int) -> torch.Tensor:
    return torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64)[1:-1]


def _bin_gaps(
    conf: torch.Tensor, target: torch.Tensor, inner_edges: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-bin (weight |B|/N, mean target, mean confidence); empty bins have weight 0."""
    n_bins = inner_edges.numel() + 1
    idx = _bin_index(conf, inner_edges)
    count = torch.bincount(idx, minlength=n_bins).to(torch.float64)
    acc = torch.bincount(idx, weights=target, minlength=n_bins) / count.clamp_min(1)
    mean_conf = torch.bincount(idx, weights=conf, minlength=n_bins) / count.clamp_min(1)
    return count / conf.numel(), acc, mean_conf


def _ece_from(p: torch.Tensor, labels: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, ...]:
    conf, correct = _conf_correct(p, labels)
    return _bin_gaps(conf, correct, _equal_width_inner_edges(n_bins))


def ece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """ECE = Σ_m (|B_m|/N)·|acc(B_m) - conf(B_m)| over equal-width bins."""
    w, acc, conf = _ece_from(_probs(logits), labels, n_bins)
    return float((w * (acc - conf).abs()).sum())


def oece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """Over-confidence part of ECE: Σ (|B|/N)·max(0, conf - acc)."""
    w, acc, conf = _ece_from(_probs(logits), labels, n_bins)
    return float((w * (conf - acc).clamp_min(0)).sum())


def uece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """Under-confidence part of ECE: Σ (|B|/N)·max(0, acc - conf); oece + uece = ece."""
    w, acc, conf = _ece_from(_probs(logits), labels, n_bins)
    return float((w * (acc - conf).clamp_min(0)).sum())


def mce(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """MCE = max over non-empty bins of |acc - conf|."""
    w, acc, conf = _ece_from(_probs(logits), labels, n_bins)
    return float((acc - conf).abs()[w > 0].max())


def _aece(p: torch.Tensor, labels: torch.Tensor, n_bins: int) -> float:
    conf, correct = _conf_correct(p, labels)
    s = conf.sort().values
    n = s.numel()
    pos = torch.linspace(0, n, n_bins + 1, dtype=torch.float64)
    lo = pos.floor().clamp(max=n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = (pos - pos.floor()).clamp(max=1.0)
    edges = s[lo] + frac * (s[hi] - s[lo])
    w, acc, mean_conf = _bin_gaps(conf, correct, edges[1:-1].contiguous())
    return float((w * (acc - mean_conf).abs()).sum())


def aece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """Adaptive ECE: the ECE sum over equal-mass bins.

    Edges e_m interpolate the sorted confidences at positions m·N/n_bins (as np.interp would,
    clamped to the last sample), bins are (e_{m-1}, e_m]. Unlike the focal-loss reference code,
    the outer bins are open-ended, so the lowest-confidence sample is not dropped.
    """
    return _aece(_probs(logits), labels, n_bins)


def _classwise_ece(p: torch.Tensor, labels: torch.Tensor, n_bins: int) -> float:
    onehot = _onehot(labels, p.shape[1])
    edges = _equal_width_inner_edges(n_bins)
    per_class = []
    for k in range(p.shape[1]):
        w, freq, mean_p = _bin_gaps(p[:, k].contiguous(), onehot[:, k].contiguous(), edges)
        per_class.append((w * (freq - mean_p).abs()).sum())
    return float(torch.stack(per_class).mean())


def classwise_ece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """(1/C)Σ_k Σ_m (|B_km|/N)·|freq(y = k in B_km) - mean p_k in B_km|, bins on p_k."""
    return _classwise_ece(_probs(logits), labels, n_bins)


def _squared_ce(
    conf: torch.Tensor, target: torch.Tensor, n_bins: int, debias: bool
) -> torch.Tensor:
    """Σ_m (|B_m|/N)·(mean target − mean conf)², less in each bin (debias) the unbiased variance
    estimate ā(1 − ā)/(|B_m| − 1) of its mean target ā that the square adds in expectation;
    bins with fewer than 2 samples add 0 when debiased (Kumar et al. 2019, §5)."""
    w, acc, mean_conf = _bin_gaps(conf, target, _equal_width_inner_edges(n_bins))
    square = (acc - mean_conf) ** 2
    if debias:
        count = w * conf.numel()
        square = torch.where(
            count >= 2, square - acc * (1 - acc) / (count - 1).clamp_min(1), torch.zeros_like(w)
        )
    return (w * square).sum()


def l2_ce(
    logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS, debias: bool = False
) -> float:
    """Top-label l2 calibration error sqrt(Σ_m (|B_m|/N)·(acc − conf)²) on ECE's bins; debias:
    the debiased estimator of Kumar, Liang & Ma (NeurIPS 2019), clipped at 0 before the root."""
    conf, correct = _conf_correct(_probs(logits), labels)
    return float(_squared_ce(conf, correct, n_bins, debias).clamp_min(0).sqrt())


def _classwise_l2_ce(p: torch.Tensor, labels: torch.Tensor, n_bins: int, debias: bool) -> float:
    onehot = _onehot(labels, p.shape[1])
    per_class = [
        _squared_ce(p[:, k].contiguous(), onehot[:, k].contiguous(), n_bins, debias).clamp_min(0)
        for k in range(p.shape[1])
    ]
    return float(torch.stack(per_class).mean().sqrt())


def classwise_l2_ce(
    logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS, debias: bool = False
) -> float:
    """Classwise (marginal) l2 calibration error sqrt((1/C)·Σ_k CE_k²), CE_k the l2 error of
    p_k against 1[y = k] on equal-width bins of p_k (Kumar et al. 2019's `marginal` mode)."""
    return _classwise_l2_ce(_probs(logits), labels, n_bins, debias)


def nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the labels (CE of the logits)."""
    return float(F.cross_entropy(logits.detach().to("cpu", torch.float64), labels.detach().cpu()))


def nll_of_probs(p: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean −log max(p_y, NLL_FLOOR): the NLL of probabilities that may hold exact zeros."""
    p_y = p.detach().to("cpu", torch.float64).gather(1, labels.detach().cpu().long()[:, None])
    return float(-p_y.clamp_min(NLL_FLOOR).log().mean())


def _brier(p: torch.Tensor, labels: torch.Tensor) -> float:
    return float((p - _onehot(labels, p.shape[1])).pow(2).sum(dim=1).mean())


def brier(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Brier = mean_i Σ_k (p_ik - 1[y_i = k])² (multi-class form, range [0, 2])."""
    return _brier(_probs(logits), labels)


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> float:
    """Fraction of samples whose label is among the k largest logits (k capped at C); the same
    for probabilities, the softmax keeping the order."""
    k = min(k, logits.shape[1])
    top = logits.detach().cpu().topk(k, dim=1).indices
    return float((top == labels.detach().cpu()[:, None]).any(dim=1).to(torch.float64).mean())


def _check_shapes(scores: torch.Tensor, labels: torch.Tensor) -> None:
    if scores.ndim != 2 or labels.shape != scores.shape[:1]:
        raise ValueError(
            f"need logits [N, C] and labels [N], got {tuple(scores.shape)}, {tuple(labels.shape)}"
        )


def probability_metrics(
    p: torch.Tensor,
    labels: torch.Tensor,
    n_bins: int = N_BINS,
    keys: tuple[str, ...] = METRIC_KEYS,
) -> dict[str, float]:
    """The metrics `keys` (default: all of docs/evaluate.md) of probabilities p [N, C] (rows
    summing to 1), in the order of METRIC_KEYS.

    Keys, x100 (percent): PERCENT_KEYS (top1, top5, ece, aece, mce, oece, uece, classwise_ece,
    smece, debiased_ece, l2_ece, classwise_l2_ece, aurc, augrc, risk_at_80).
    Keys, raw: nll (nats, `nll_of_probs`), brier (in [0, 2]), n (sample count).
    """
    _check_shapes(p, labels)
    p = p.detach().to("cpu", torch.float64)
    y = labels.detach().cpu().long()
    conf, correct = _conf_correct(p, y)

    def binned(reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        w, acc, mean_conf = _bin_gaps(conf, correct, _equal_width_inner_edges(n_bins))
        return float(reduce(w, acc - mean_conf))  # gap = acc - conf per bin

    metric: dict[str, Callable[[], float]] = {
        "top1": lambda: topk_accuracy(p, y, 1),
        "top5": lambda: topk_accuracy(p, y, 5),
        "ece": lambda: binned(lambda w, gap: (w * gap.abs()).sum()),
        "aece": lambda: _aece(p, y, n_bins),
        "mce": lambda: binned(lambda w, gap: gap.abs()[w > 0].max()),
        "oece": lambda: binned(lambda w, gap: (w * (-gap).clamp_min(0)).sum()),
        "uece": lambda: binned(lambda w, gap: (w * gap.clamp_min(0)).sum()),
        "classwise_ece": lambda: _classwise_ece(p, y, n_bins),
        "smece": lambda: smooth_ece(conf, correct),
        "debiased_ece": lambda: float(_squared_ce(conf, correct, n_bins, True).clamp_min(0).sqrt()),
        "l2_ece": lambda: float(_squared_ce(conf, correct, n_bins, False).sqrt()),
        "classwise_l2_ece": lambda: _classwise_l2_ce(p, y, n_bins, False),
        "aurc": lambda: aurc(conf, correct),
        "augrc": lambda: augrc(conf, correct),
        "risk_at_80": lambda: risk_at_coverage(conf, correct, 0.8),
        "nll": lambda: nll_of_probs(p, y),
        "brier": lambda: _brier(p, y),
        "n": lambda: float(y.numel()),
    }
    unknown = set(keys) - set(metric)
    if unknown:
        raise ValueError(f"unknown metric(s) {sorted(unknown)}; choose from {METRIC_KEYS}")
    return {
        k: (100.0 if k in PERCENT_KEYS else 1.0) * metric[k]() for k in METRIC_KEYS if k in keys
    }


def calibration_metrics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    n_bins: int = N_BINS,
    keys: tuple[str, ...] = METRIC_KEYS,
) -> dict[str, float]:
    """`probability_metrics` of softmax(logits), with top-1/top-5 ranked by the logits and the
    NLL exact from them (F.cross_entropy, no floor)."""
    _check_shapes(logits, labels)
    out = probability_metrics(_probs(logits), labels, n_bins, keys)
    exact = {
        "top1": lambda: 100.0 * topk_accuracy(logits, labels, 1),
        "top5": lambda: 100.0 * topk_accuracy(logits, labels, 5),
        "nll": lambda: nll(logits, labels),
    }
    return out | {k: f() for k, f in exact.items() if k in out}


def reliability_bins(
    confidences: torch.Tensor, correct: torch.Tensor, n_bins: int = N_BINS
) -> dict[str, torch.Tensor]:
    """Per-bin data for a reliability diagram: edges [n_bins+1], acc/conf [n_bins] (NaN where
    the bin is empty), count [n_bins] (int64). `correct` is bool or 0/1."""
    conf = confidences.detach().to("cpu", torch.float64)
    hit = correct.detach().to("cpu", torch.float64)
    edges = _equal_width_inner_edges(n_bins)
    _, acc, mean_conf = _bin_gaps(conf, hit, edges)
    count = torch.bincount(_bin_index(conf, edges), minlength=n_bins)
    empty = count == 0
    return {
        "edges": torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64),
        "acc": acc.masked_fill(empty, float("nan")),
        "conf": mean_conf.masked_fill(empty, float("nan")),
        "count": count,
    }


def temperature_grid() -> list[float]:
    """docs/methods.md §7 grid T ∈ {0.1, 0.2, ..., 10.0}."""
    return [round(0.1 * i, 1) for i in range(1, 101)]


TS_CRITERIA = ("nll", "ece")
NLL_T_RANGE = (0.05, 20.0)  # the NLL fit searches T in this range


def fit_temperature_nll(
    val_logits: torch.Tensor, val_labels: torch.Tensor, t_range: tuple[float, float] = NLL_T_RANGE
) -> float:
    """T minimising the validation NLL of softmax(s/T) (Guo et al. 2017), T in `t_range`.

    NLL(β) = mean_i[logsumexp(β·s_i) − β·s_iy] is convex in β = 1/T (a log-sum-exp of linear
    functions minus a linear one), so a golden-section search on β finds the global minimum
    of the range; 80 iterations shrink the bracket below 1e-15 of its width. Each NLL(β) is
    β·mean max(s) + mean log Σ_k exp(β·(s_k − max s)) − β·mean s_y with the differences kept
    class-major (F.cross_entropy's value to rounding, ~3x faster: evaluate calls this once per
    run and once per post-hoc fold).
    """
    s = val_logits.detach().to("cpu", torch.float64)
    y = val_labels.detach().cpu().long()
    top = s.max(dim=1).values
    below = (s - top[:, None]).T.contiguous()  # [C, N], <= 0
    mean_top, mean_label = float(top.mean()), float(s.gather(1, y[:, None]).mean())

    def nll_at(beta: float) -> float:
        log_sum = float(torch.log(torch.exp(below * beta).sum(dim=0)).mean())
        return beta * mean_top + log_sum - beta * mean_label

    lo, hi = 1.0 / t_range[1], 1.0 / t_range[0]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    b1, b2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    f1, f2 = nll_at(b1), nll_at(b2)
    for _ in range(80):
        if f1 <= f2:
            hi, b2, f2 = b2, b1, f1
            b1 = hi - ratio * (hi - lo)
            f1 = nll_at(b1)
        else:
            lo, b1, f1 = b1, b2, f2
            b2 = lo + ratio * (hi - lo)
            f2 = nll_at(b2)
    return 1.0 / ((lo + hi) / 2.0)


def fit_temperature(
    val_logits: torch.Tensor,
    val_labels: torch.Tensor,
    grid: list[float] | None = None,
    n_bins: int = N_BINS,
    criterion: str = "ece",
) -> float:
    """Temperature T for `logits / T`, fitted on validation logits (docs/methods.md §7).

    criterion "nll": the NLL minimiser in NLL_T_RANGE (`fit_temperature_nll`, the usual choice);
    "ece": the grid T ∈ {0.1, ..., 10.0} with the lowest validation ECE (the focal-calibration
    code's criterion; ties -> smaller T).
    """
    if criterion not in TS_CRITERIA:
        raise ValueError(f"criterion must be one of {TS_CRITERIA}, got {criterion!r}")
    if criterion == "nll":
        return fit_temperature_nll(val_logits, val_labels)
    grid = temperature_grid() if grid is None else grid
    if not grid or min(grid) <= 0:
        raise ValueError(f"temperature grid must be non-empty and positive, got {grid}")
    s = val_logits.detach().to("cpu", torch.float64)
    scores = [ece(s / t, val_labels, n_bins) for t in grid]
    return float(grid[min(range(len(grid)), key=scores.__getitem__)])


def temperature_on_edge(t: float, criterion: str) -> bool:
    """A T on the edge of its search range means the fit is degenerate (docs/methods.md §7)."""
    low, high = NLL_T_RANGE if criterion == "nll" else (min(temperature_grid()), 10.0)
    return t <= low * (1 + 1e-6) or t >= high * (1 - 1e-6)


def ensemble_logits(members: list[torch.Tensor]) -> torch.Tensor:
    """Deep-ensemble logits log((1/M)Σ_m softmax(s_m)): softmax of them is the mean softmax."""
    if not members or any(m.shape != members[0].shape for m in members):
        raise ValueError("ensemble needs >= 1 member logits, all of the same shape [N, C]")
    log_p = torch.stack([F.log_softmax(m.float(), dim=1) for m in members])
    return torch.logsumexp(log_p, dim=0) - math.log(len(members))
