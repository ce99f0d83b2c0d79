"""Out-of-distribution detection from a classifier's logits (docs/evaluate.md).

In-distribution (ID) samples are the positive class; every score is "higher = more ID":

    msp      max_k softmax(s)_k                   (Hendrycks & Gimpel 2017)
    entropy  Σ_k p_k log p_k  (the negative entropy)
    maxlogit max_k s_k                            (Hendrycks et al. 2022)
    energy   log Σ_k exp(s_k) (the negative free energy −E(s) at T = 1, Liu et al. 2020)

and each is summarised by AUROC, FPR at 95 % ID TPR, AUPR-in (average precision with ID
positive) and AUPR-out (OOD positive, the score negated). max-logit and energy read the raw
logits, so they mean something for one network only: the "logits" of a deep ensemble are
log mean softmax (models/calibration.py ensemble_logits), whose energy is 0 for every sample.
Everything is float64 on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn import functional as F


def _flat(scores: torch.Tensor) -> torch.Tensor:
    return scores.detach().to("cpu", torch.float64).flatten()


def auroc(pos_scores: torch.Tensor, neg_scores: torch.Tensor) -> float:
    """P(score_pos > score_neg) + ½·P(tie), by the Mann-Whitney rank sum with mid-ranks."""
    pos, neg = _flat(pos_scores), _flat(neg_scores)
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
    pos = _flat(pos_scores).sort(descending=True).values
    neg = _flat(neg_scores)
    k = max(1, math.ceil(tpr * pos.numel() - 1e-9))  # positives that must stay above t
    return float((neg >= pos[k - 1]).to(torch.float64).mean())


def average_precision(pos_scores: torch.Tensor, neg_scores: torch.Tensor) -> float:
    """AP = Σ_n (R_n − R_{n−1})·P_n over the distinct thresholds, highest first (R_0 = 0): the
    step-wise area under the precision-recall curve, without interpolation (as sklearn's
    average_precision_score)."""
    pos, neg = _flat(pos_scores), _flat(neg_scores)
    if pos.numel() == 0:
        raise ValueError("average precision needs at least one positive score")
    scores = torch.cat([pos, neg])
    hit = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
    order = torch.sort(scores, descending=True, stable=True).indices
    scores, hit = scores[order], hit[order]
    last = torch.ones_like(scores, dtype=torch.bool)  # the last sample of each tied run
    last[:-1] = scores[1:] != scores[:-1]
    tp = torch.cumsum(hit, 0)[last]
    seen = torch.cumsum(torch.ones_like(hit), 0)[last]
    recall = tp / pos.numel()
    step = recall - torch.cat([recall.new_zeros(1), recall[:-1]])
    return float((step * tp / seen).sum())


def _neg_entropy(s: torch.Tensor) -> torch.Tensor:
    p = F.softmax(s, dim=1)
    return (p * p.clamp_min(1e-300).log()).sum(dim=1)


SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "msp": lambda s: F.softmax(s, dim=1).max(dim=1).values,
    "entropy": _neg_entropy,
    "maxlogit": lambda s: s.max(dim=1).values,
    "energy": lambda s: torch.logsumexp(s, dim=1),
}
LOGIT_SCORES = ("maxlogit", "energy")  # read the raw logits (meaningless for an ensemble)


def ood_scores(
    id_logits: torch.Tensor, ood_logits: torch.Tensor, logit_scores: bool = True
) -> dict[str, float]:
    """For every score of SCORES (without max-logit and energy when `logit_scores` is False),
    `<score>_auroc`, `<score>_fpr95`, `<score>_aupr_in` and `<score>_aupr_out`, all x100."""
    s_id, s_ood = _flat(id_logits).view(id_logits.shape), _flat(ood_logits).view(ood_logits.shape)
    out = {}
    for name, score in SCORES.items():
        if name in LOGIT_SCORES and not logit_scores:
            continue
        i, o = score(s_id), score(s_ood)
        out |= {
            f"{name}_auroc": 100.0 * auroc(i, o),
            f"{name}_fpr95": 100.0 * fpr_at_tpr(i, o, 0.95),
            f"{name}_aupr_in": 100.0 * average_precision(i, o),
            f"{name}_aupr_out": 100.0 * average_precision(-o, -i),
        }
    return out
