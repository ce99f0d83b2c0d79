"""The study's figures: reliability.png (ce and the csm family, seeds pooled) and ece.png (ECE
per method, mean ± std over seeds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.plots import error_bars, reliability_diagram
from pipeline.study.config import StudyConfig
from pipeline.study.stats import Predictions, softmax


def figures(cfg: StudyConfig, root: Path, out: Path, preds: dict, summary: dict) -> None:
    """reliability.png (ce vs csm, csm3 and csm-redraw, seeds pooled); ece.png (ECE per method, error bars)."""
    import torch

    from models.calibration import reliability_bins

    panels = {}
    for method in [m for m in ("ce", "csm", "csm3", "csm-redraw") if m in preds]:
        runs = preds[method]
        pooled = Predictions(
            *(np.concatenate([getattr(p, f) for p in runs]) for f in Predictions.FIELDS)
        )
        prob = softmax(pooled.logits)
        correct = torch.from_numpy(prob.argmax(axis=1) == pooled.labels)
        bins = reliability_bins(torch.from_numpy(prob.max(axis=1)), correct)
        panels[f"{method} ({len(runs)} seeds pooled)"] = {
            k: bins[k].tolist() for k in ("acc", "conf", "count")
        } | {"ece": 100.0 * pooled.ece()}
    reliability_diagram(panels, out / "reliability.png", title=f"{root.name}: test, before TS")
    error_bars(
        {
            when: {m: (s[f"{key}.ece"]["mean"], s[f"{key}.ece"]["std"]) for m, s in summary.items()}
            for when, key in (("before TS", "before_ts"), ("after TS", "after_ts"))
        },
        out / "ece.png",
        ylabel="test ECE (%)",
        title=f"{root.name}: ECE per method, mean ± std over seeds",
    )
