"""The study's figures: reliability.png (ce and the csm family, seeds pooled), ece.png (ECE per
method, mean ± std over seeds) and, where the study chose the generator's sampler cell,
fidelity.png (every cell's fidelity against w, the floor, the kept cells, the study's choice)
and, with the robustness table, shift.png (ECE and NLL after TS against severity)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from core.plots import error_bars, guidance_cells, reliability_diagram
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


def cell_marks(generator: dict) -> dict:
    """What fidelity.png draws from study.json's `generator` (pipeline/study/cells.py): every
    cell (clipping, w, fidelity), the floor, the kept cells and the study's choice, and a title
    naming that choice (not the fit's most faithful cell, which the study may overrule)."""

    def key(c: dict) -> tuple[str | None, float]:
        return (c["clip"], float(c["guidance"]))

    chosen = key(generator["chosen"])
    clip = f", x̂₀ clipping {chosen[0]}" if chosen[0] else ""
    fit = key(generator["reference"])
    return {
        "cells": [(*key(c), float(c["fidelity"])) for c in generator["cells"]],
        "floor": generator["fidelity_floor"],
        "kept": [key(c) for c in generator["cells"] if c.get("kept")],
        "chosen": chosen,
        "chosen_label": "the study's choice (val NLL)",
        "title": f"generator cells: the study chose w = {chosen[1]:g}{clip} on val "
        f"(the fit's most faithful: w = {fit[1]:g}{f', clipping {fit[0]}' if fit[0] else ''})",
    }


def fidelity_figure(generator: dict, path: Path) -> Path:
    """fidelity.png of the study's generator cells (cell_marks)."""
    marks = cell_marks(generator)
    return guidance_cells(marks.pop("cells"), path, **marks)


def shift_figure(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """ECE and NLL after TS vs severity (0 = clean test), one line per method: the shape of
    MaC-Cal's Fig. 5."""
    from core.plots import panels

    methods = list(dict.fromkeys(r["method"] for r in records))

    def curve(method: str, key: str) -> tuple[list[int], list[float]]:
        runs = [r for r in records if r["method"] == method]
        ys = [float(np.mean([r["after_ts"][key] for r in runs]))]
        ys += [
            float(np.mean([r["shift"]["after_ts"][str(s)][key] for r in runs])) for s in range(1, 6)
        ]
        return list(range(6)), ys

    data = {
        label: {m: curve(m, key) for m in methods}
        for key, label in (("ece", "ECE after TS (%)"), ("nll", "NLL after TS"))
    }
    return panels(data, path, xlabel="severity (0 = clean test)", title=title)
