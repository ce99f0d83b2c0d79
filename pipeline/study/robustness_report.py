"""The robustness table's section of report.md: mean ECE / NLL per severity and method under
shift, the paired comparisons under severe shift (pipeline/study/robustness_stats.py), the goal,
the far-OOD table and its paired comparisons."""

from __future__ import annotations

from typing import Any

import numpy as np

from core.tables import table
from pipeline.study.plan import SHIFT_IMAGES
from pipeline.study.robustness_stats import SEVERE
from pipeline.study.stats import MARGINS

GOAL = 0.2  # csm + TS's ECE under severe shift at least 20 % below ce + TS's
SHIFT_HEADINGS = (
    "method",
    "ECE after TS, severity 1 / 2 / 3 / 4 / 5",
    "NLL after TS, 1 / 3 / 5",
    "top-1, 1 / 3 / 5",
)
PAIRED_HEADINGS = (
    "",
    "metric",
    "method − reference",
    "difference",
    "relative",
    "95 % t interval",
    "verdict",
)
OOD_PAIRED_HEADINGS = ("OOD set", "method − ce", "AUROC difference", "95 % t interval", "verdict")


def report_lines(
    summary_records: list[dict[str, Any]], paired: dict, ood_paired: dict | None = None
) -> list[str]:
    """The robustness section of report.md: mean ECE / NLL per severity and method, the paired
    comparisons under severe shift, the goal, the OOD table and its paired comparisons."""
    methods = list(dict.fromkeys(r["method"] for r in summary_records))
    by = {m: [r for r in summary_records if r["method"] == m] for m in methods}

    def mean(m: str, when: str, sev: str, key: str) -> float:
        return float(np.mean([r["shift"][when][sev][key] for r in by[m]]))

    lines = [
        "## Under shift: the corrupted test split (x100 except NLL)",
        "",
        f"{SHIFT_IMAGES} test images under each corruption and severity (`shift` stage, "
        "docs/shift.md); the mean over corruptions, then over seeds. Temperature and every "
        "calibrator fitted on clean val.",
        "",
    ]
    rows = []
    for m in methods:
        ece = " / ".join(f"{mean(m, 'after_ts', str(s), 'ece'):.2f}" for s in range(1, 6))
        nll = " / ".join(f"{mean(m, 'after_ts', str(s), 'nll'):.3f}" for s in (1, 3, 5))
        top1 = " / ".join(f"{mean(m, 'after_ts', str(s), 'top1'):.1f}" for s in (1, 3, 5))
        rows.append([m, ece, nll, top1])
    lines += table(SHIFT_HEADINGS, rows)
    lines += [
        "",
        f"Paired by seed and test image, severities {', '.join(map(str, SEVERE))}, mean over "
        "corruptions (method − ce; margins as in the main table):",
        "",
    ]
    rows = []
    for when, by_metric in paired.items():
        for metric, by_ref in by_metric.items():
            for reference, by_method in by_ref.items():
                for method, r in by_method.items():
                    d = 4 if metric == "nll" else 2
                    rel = "–" if r["relative"] is None else f"{100 * r['relative']:+.0f} %"
                    lo, hi = r["ci95"]
                    rows.append([
                        when.replace("_ts", " TS").replace("_", " "), metric,
                        f"{method} − {reference}", f"{r['difference']:+.{d}f}", rel,
                        f"[{lo:+.{d}f}, {hi:+.{d}f}]{_which(r)}", r["verdict"],
                    ])  # fmt: skip
    lines += table(PAIRED_HEADINGS, rows)
    goal = paired.get("after_ts", {}).get("ece", {}).get("ce", {}).get("csm")
    if goal:
        better = goal["verdict"] == "better"
        ok = goal["relative"] is not None and -goal["relative"] >= GOAL and better
        lines += [
            "",
            f"- Goal: under severe shift csm + TS's ECE >= {100 * GOAL:.0f} % below ce + TS's, "
            f"the t and percentile intervals below 0: {100 * -goal['relative']:.0f} % lower, "
            f"[{goal['ci95'][0]:+.2f}, {goal['ci95'][1]:+.2f}]: **{'yes' if ok else 'no'}**",
        ]
    sets = list(dict.fromkeys(s for r in summary_records for s in r["ood"]))
    if sets:
        lines += [
            "",
            "## Far-OOD detection (max softmax, ID = positive; x100)",
            "",
        ]
        headings = ["method", *(f"{s} {key}" for s in sets for key in ("AUROC", "FPR95"))]
        rows = []
        for m in methods:
            cells = []
            for s in sets:
                for key in ("auroc", "fpr95"):
                    v = [r["ood"][s][key] for r in by[m]]
                    cells.append(f"{np.mean(v):.1f} ± {np.std(v, ddof=1) if len(v) > 1 else 0:.1f}")
            rows.append([m, *cells])
        lines += table(headings, rows)
    if ood_paired:
        lines += [
            "",
            "AUROC, method − ce, paired by seed and image (test and OOD images resampled "
            "together; the verdict on 1 − AUROC against a margin of "
            f"{MARGINS['auroc_shortfall']:g} AUROC point, fixed before the run):",
            "",
        ]
        rows = []
        for ood_set, by_method in ood_paired.items():
            for method, r in by_method.items():
                lo, hi = (-v for v in r["ci95"])  # AUROC = 100 − shortfall: the signs flip
                rows.append([
                    ood_set, f"{method} − ce", f"{-r['difference']:+.2f}",
                    f"[{hi:+.2f}, {lo:+.2f}]{_which(r)}", r["verdict"],
                ])  # fmt: skip
        lines += table(OOD_PAIRED_HEADINGS, rows)
    return [*lines, ""]


def _which(r: dict[str, Any]) -> str:
    """The interval's name where it is not the t one (one seed: the percentile interval)."""
    return "" if r["interval"] == "t" else f" ({r['interval']})"
