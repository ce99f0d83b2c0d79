"""The numbers of one evaluation, from logits (part of the evaluate stage; docs/evaluate.md).

Kept apart so that stages/evaluate/stage.py reads as the stage (runs, data, folders): here are the
metric sections of `metrics.json`'s "evaluation" besides `before_ts` / `after_ts`:

    posthoc      every post-hoc calibrator (models/posthoc.py) fitted on val, its test metrics,
                 the cross-validated val NLL that chose the best one
    ood          OOD scores before and after TS
    corruptions  ECE, NLL, Brier and top-1 per corruption and severity, before and after TS and
                 after the best post-hoc calibrator, plus their means per severity
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from models.calibration import calibration_metrics, probability_metrics
from models.ood import ood_scores
from models.posthoc import CRITERION, CV_FOLDS, PosthocFit

SHIFT_KEYS = ("ece", "nll", "brier", "top1")  # per corruption and severity
SEVERITIES = 5


def posthoc_section(
    fit: PosthocFit, test_probs: dict[str, torch.Tensor], labels: torch.Tensor
) -> dict[str, Any]:
    """{criterion, folds, best, val_nll: {calibrator: NLL}, after: {calibrator: test metrics}}."""
    return {
        "criterion": CRITERION,
        "folds": CV_FOLDS,
        "best": fit.best,
        "val_nll": dict(fit.val_nll),
        "after": {name: probability_metrics(p, labels) for name, p in test_probs.items()},
    }


def ood_section(
    test: torch.Tensor, ood: torch.Tensor, t: float, one_network: bool
) -> dict[str, Any]:
    """OOD scores of the test (ID) against the OOD logits, before and after TS; max-logit and
    energy only for one network (an ensemble's logits are log mean softmax)."""
    return {
        "before_ts": ood_scores(test, ood, logit_scores=one_network),
        "after_ts": ood_scores(test / t, ood / t, logit_scores=one_network),
    }


def _copied(images: np.ndarray) -> np.ndarray:
    """A writable copy of one severity's images out of the memory map. A grey set comes as a
    view repeating its one channel (evals.corruption_sets, a stride of 0): copying that view
    goes byte by byte, ~3x slower than copying the channel and repeating it (same bytes)."""
    if images.shape[-1] == 3 and images.strides[-1] == 0:
        return np.repeat(np.array(images[..., :1]), 3, axis=-1)
    return np.array(images)


def corruption_metrics(
    sets: dict[str, np.ndarray],
    labels: np.ndarray,
    logits_of: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    temps: dict[str, float],
    posthoc: dict[str, PosthocFit],
) -> tuple[dict[str, dict], dict[str, dict[str, np.ndarray]]]:
    """({entry: {before_ts|after_ts|after_posthoc: {corruption: {severity: {ece, nll, brier,
    top1}}, "mean": {severity: ...}}, posthoc_method: name}}, {entry: arrays}); after_posthoc
    applies the entry's best post-hoc calibrator (fitted on clean val), named by
    posthoc_method. ECE and top-1 x100, NLL in nats (exact from the logits before and after TS;
    floored as models/calibration.py nll_of_probs after the calibrator), Brier raw. The arrays,
    for statistics paired by image (pipeline/study/robustness_stats.py): `corruption_logits` float32
    [corruptions, 5, N, C] in `corruption_names` order, `corruption_labels` [N]."""
    whens = ("before_ts", "after_ts", "after_posthoc")
    out: dict[str, dict] = {name: {w: {} for w in whens} for name in temps}
    kept: dict[str, list[list[torch.Tensor]]] = {name: [] for name in temps}
    y = torch.zeros(0, dtype=torch.long)
    for corruption, arr in sets.items():
        for name in kept:
            kept[name].append([])
        n = arr.shape[0] // SEVERITIES
        for s in range(SEVERITIES):
            y = torch.from_numpy(
                np.asarray(labels[s * n : (s + 1) * n] if len(labels) > n else labels)
            ).long()
            logits = logits_of(torch.from_numpy(_copied(arr[s * n : (s + 1) * n])))
            for name, lg in logits.items():
                kept[name][-1].append(lg.float())
                rows = {
                    "before_ts": calibration_metrics(lg, y, keys=SHIFT_KEYS),
                    "after_ts": calibration_metrics(lg / temps[name], y, keys=SHIFT_KEYS),
                    "after_posthoc": probability_metrics(
                        posthoc[name].calibrators[posthoc[name].best].probs(lg), y, keys=SHIFT_KEYS
                    ),
                }
                for when, row in rows.items():
                    out[name][when].setdefault(corruption, {})[str(s + 1)] = {
                        k: row[k] for k in SHIFT_KEYS
                    }
    for result in out.values():
        for when in whens:
            per = list(result[when].values())
            result[when]["mean"] = {
                str(s): {m: float(np.mean([p[str(s)][m] for p in per])) for m in SHIFT_KEYS}
                for s in range(1, SEVERITIES + 1)
            }
    for name, result in out.items():
        result["posthoc_method"] = posthoc[name].best
    arrays = {
        name: {
            "corruption_logits": torch.stack([torch.stack(c) for c in per]).numpy(),
            "corruption_names": np.array(list(sets), dtype=str),
            "corruption_labels": y.numpy().astype(np.int64),
        }
        for name, per in kept.items()
    }
    return out, arrays
