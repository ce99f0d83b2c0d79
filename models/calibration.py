"""Calibration, accuracy and OOD metrics, temperature scaling, ensembles (METHODS §6-7).

Inputs are torch tensors: logits [N, C] (any dtype/device) and integer labels [N]. Everything is
computed in float64 on the CPU (metrics run once per evaluation; exactness beats speed here).
The single-metric functions return fractions in [0, 1] as Python floats; the two report
functions `calibration_metrics` and `ood_scores` return dicts scaled x100 where the quantity is
a percentage (each docstring lists which).

Binning (METHODS §7): 15 equal-width bins, bin m = ((m-1)/15, m/15]; a confidence of exactly 0
falls into the first bin. torchmetrics uses [lo, hi) bins instead, which only differs for
confidences exactly on an edge.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

N_BINS = 15


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return F.softmax(logits.detach().to("cpu", torch.float64), dim=1)


def _conf_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, y_hat = _probs(logits).max(dim=1)
    return c, (y_hat == labels.detach().cpu()).to(torch.float64)


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


def _ece_from(logits: torch.Tensor, labels: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, ...]:
    conf, correct = _conf_correct(logits, labels)
    return _bin_gaps(conf, correct, _equal_width_inner_edges(n_bins))


def ece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """ECE = Σ_m (|B_m|/N)·|acc(B_m) - conf(B_m)| over equal-width bins."""
    w, acc, conf = _ece_from(logits, labels, n_bins)
    return float((w * (acc - conf).abs()).sum())


def oece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """Over-confidence part of ECE: Σ (|B|/N)·max(0, conf - acc)."""
    w, acc, conf = _ece_from(logits, labels, n_bins)
    return float((w * (conf - acc).clamp_min(0)).sum())


def uece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """Under-confidence part of ECE: Σ (|B|/N)·max(0, acc - conf); oece + uece = ece."""
    w, acc, conf = _ece_from(logits, labels, n_bins)
    return float((w * (acc - conf).clamp_min(0)).sum())


def mce(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """MCE = max over non-empty bins of |acc - conf|."""
    w, acc, conf = _ece_from(logits, labels, n_bins)
    return float((acc - conf).abs()[w > 0].max())


def aece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """Adaptive ECE: the ECE sum over equal-mass bins.

    Edges e_m interpolate the sorted confidences at positions m·N/n_bins (as np.interp would,
    clamped to the last sample), bins are (e_{m-1}, e_m]. Unlike the focal-loss reference code,
    the outer bins are open-ended, so the lowest-confidence sample is not dropped.
    """
    conf, correct = _conf_correct(logits, labels)
    s = conf.sort().values
    n = s.numel()
    pos = torch.linspace(0, n, n_bins + 1, dtype=torch.float64)
    lo = pos.floor().clamp(max=n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = (pos - pos.floor()).clamp(max=1.0)
    edges = s[lo] + frac * (s[hi] - s[lo])
    w, acc, mean_conf = _bin_gaps(conf, correct, edges[1:-1].contiguous())
    return float((w * (acc - mean_conf).abs()).sum())


def classwise_ece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS) -> float:
    """(1/C)Σ_k Σ_m (|B_km|/N)·|freq(y = k in B_km) - mean p_k in B_km|, bins on p_k."""
    p = _probs(logits)
    onehot = F.one_hot(labels.detach().cpu().long(), p.shape[1]).to(torch.float64)
    edges = _equal_width_inner_edges(n_bins)
    per_class = []
    for k in range(p.shape[1]):
        w, freq, mean_p = _bin_gaps(p[:, k].contiguous(), onehot[:, k].contiguous(), edges)
        per_class.append((w * (freq - mean_p).abs()).sum())
    return float(torch.stack(per_class).mean())


def nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the labels (CE of the logits)."""
    return float(F.cross_entropy(logits.detach().to("cpu", torch.float64), labels.detach().cpu()))


def brier(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Brier = mean_i Σ_k (p_ik - 1[y_i = k])² (multi-class form, range [0, 2])."""
    p = _probs(logits)
    onehot = F.one_hot(labels.detach().cpu().long(), p.shape[1]).to(torch.float64)
    return float((p - onehot).pow(2).sum(dim=1).mean())


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 1) -> float:
    """Fraction of samples whose label is among the k largest logits (k capped at C)."""
    k = min(k, logits.shape[1])
    top = logits.detach().cpu().topk(k, dim=1).indices
    return float((top == labels.detach().cpu()[:, None]).any(dim=1).to(torch.float64).mean())


def calibration_metrics(
    logits: torch.Tensor, labels: torch.Tensor, n_bins: int = N_BINS
) -> dict[str, float]:
    """All METHODS §7 metrics of one set of logits.

    Keys, x100 (percent): top1, top5, ece, aece, mce, oece, uece, classwise_ece.
    Keys, raw: nll (nats), brier (in [0, 2]), n (sample count).
    """
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"need logits [N, C] and labels [N], got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    pct = {
        "top1": topk_accuracy(logits, labels, 1),
        "top5": topk_accuracy(logits, labels, 5),
        "ece": ece(logits, labels, n_bins),
        "aece": aece(logits, labels, n_bins),
        "mce": mce(logits, labels, n_bins),
        "oece": oece(logits, labels, n_bins),
        "uece": uece(logits, labels, n_bins),
        "classwise_ece": classwise_ece(logits, labels, n_bins),
    }
    out = {k: 100.0 * v for k, v in pct.items()}
    out.update(nll=nll(logits, labels), brier=brier(logits, labels), n=float(labels.numel()))
    return out


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
    """METHODS §7 grid T ∈ {0.1, 0.2, ..., 10.0}."""
    return [round(0.1 * i, 1) for i in range(1, 101)]


TS_CRITERIA = ("nll", "ece")
NLL_T_RANGE = (0.05, 20.0)  # the NLL fit searches T in this range


def fit_temperature_nll(
    val_logits: torch.Tensor, val_labels: torch.Tensor, t_range: tuple[float, float] = NLL_T_RANGE
) -> float:
    """T minimising the validation NLL of softmax(s/T) (Guo et al. 2017), T in `t_range`.

    NLL(β) = mean_i[logsumexp(β·s_i) − β·s_iy] is convex in β = 1/T (a log-sum-exp of linear
    functions minus a linear one), so a golden-section search on β finds the global minimum
    of the range; 80 iterations shrink the bracket below 1e-15 of its width.
    """
    s = val_logits.detach().to("cpu", torch.float64)
    y = val_labels.detach().cpu().long()

    def nll_at(beta: float) -> float:
        return float(F.cross_entropy(s * beta, y))

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
    """Temperature T for `logits / T`, fitted on validation logits (METHODS §7).

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
    """A T on the edge of its search range means the fit is degenerate (METHODS §7)."""
    low, high = NLL_T_RANGE if criterion == "nll" else (min(temperature_grid()), 10.0)
    return t <= low * (1 + 1e-6) or t >= high * (1 - 1e-6)


def auroc(pos_scores: torch.Tensor, neg_scores: torch.Tensor) -> float:
    """P(score_pos > score_neg) + ½·P(tie), by the Mann-Whitney rank sum with mid-ranks."""
    pos = pos_scores.detach().to("cpu", torch.float64).flatten()
    neg = neg_scores.detach().to("cpu", torch.float64).flatten()
    if pos.numel() == 0 or neg.numel() == 0:
        raise ValueError("auroc needs at least one positive and one negative score")
    both = torch.cat([pos, neg])
    _, inverse, counts = torch.unique(both, sorted=True, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts  # tied values share the mean of their 1-based ranks
    mid_rank = start.to(torch.float64) + (counts.to(torch.float64) + 1) / 2
    rank_sum = mid_rank[inverse[: pos.numel()]].sum()
    n_p, n_n = pos.numel(), neg.numel()
    return float((rank_sum - n_p * (n_p + 1) / 2) / (n_p * n_n))


def fpr_at_tpr(pos_scores: torch.Tensor, neg_scores: torch.Tensor, tpr: float = 0.95) -> float:
    """Fraction of negatives scoring >= t, for the highest threshold t that keeps >= `tpr` of the
    positives (score >= t): the lowest FPR reachable at that TPR."""
    pos = pos_scores.detach().to("cpu", torch.float64).flatten().sort(descending=True).values
    neg = neg_scores.detach().to("cpu", torch.float64).flatten()
    k = max(1, math.ceil(tpr * pos.numel() - 1e-9))  # positives that must stay above t
    return float((neg >= pos[k - 1]).to(torch.float64).mean())


def ood_scores(id_logits: torch.Tensor, ood_logits: torch.Tensor) -> dict[str, float]:
    """OOD detection with in-distribution as the positive class (METHODS §7), all x100:
    msp_auroc, msp_fpr95 (FPR at 95 % ID TPR, MSP score), entropy_auroc (score = -entropy)."""
    p_id, p_ood = _probs(id_logits), _probs(ood_logits)
    msp_id, msp_ood = p_id.max(dim=1).values, p_ood.max(dim=1).values

    def neg_entropy(p: torch.Tensor) -> torch.Tensor:
        return (p * p.clamp_min(1e-300).log()).sum(dim=1)

    return {
        "msp_auroc": 100.0 * auroc(msp_id, msp_ood),
        "msp_fpr95": 100.0 * fpr_at_tpr(msp_id, msp_ood, 0.95),
        "entropy_auroc": 100.0 * auroc(neg_entropy(p_id), neg_entropy(p_ood)),
    }


def ensemble_logits(members: list[torch.Tensor]) -> torch.Tensor:
    """Deep-ensemble logits log((1/M)Σ_m softmax(s_m)): softmax of them is the mean softmax."""
    if not members or any(m.shape != members[0].shape for m in members):
        raise ValueError("ensemble needs >= 1 member logits, all of the same shape [N, C]")
    log_p = torch.stack([F.log_softmax(m.float(), dim=1) for m in members])
    return torch.logsumexp(log_p, dim=0) - math.log(len(members))
