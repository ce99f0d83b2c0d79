"""`make study`'s outputs: study/report.md (tables of every method against ce) and the figures.

Split from `pipeline.study` (which plans and runs the study) so each reads top to bottom.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.io import atomic_write_bytes
from core.plots import error_bars, reliability_diagram
from pipeline.study_config import StudyConfig
from pipeline.study_stats import Predictions, softmax


def _pm(stats: dict[str, float], digits: int = 2) -> str:
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


COLUMNS = (
    ("top1", "top-1", 2), ("ece", "ECE", 2), ("aece", "AECE", 2), ("classwise_ece", "cw-ECE", 3),
    ("oece", "O-ECE", 2), ("uece", "U-ECE", 2), ("nll", "NLL", 4), ("brier", "Brier", 4),
)  # fmt: skip


def _ci(b: dict, digits: int = 2) -> str:
    return f"[{b['ci95'][0]:+.{digits}f}, {b['ci95'][1]:+.{digits}f}]"


def _goal(summary: dict, boot: dict, boot_nll: dict | None, kway: dict | None) -> list[str]:
    """The study's goals for csm, each with its verdict. "No worse" after TS: the 95 % interval
    of the difference reaches 0 (csm + TS is not measurably worse than ce + TS)."""
    ce, csm, b = summary["ce"], summary["csm"], boot["before_ts"]["csm"]
    d_acc = csm["before_ts.top1"]["mean"] - ce["before_ts.top1"]["mean"]
    checks = [
        (
            f"ECE {_pm(csm['before_ts.ece'])} vs ce {_pm(ce['before_ts.ece'])}: "
            f"{abs(100 * b['relative']):.0f} % {'lower' if b['relative'] < 0 else 'higher'}, "
            f"ΔECE interval {_ci(b)} (goal: >= 30 % lower, interval below 0)",
            -b["relative"] >= 0.3 and b["ci95"][1] < 0,
        ),
        (f"top-1 {d_acc:+.2f} points (goal >= -0.5)", d_acc >= -0.5),
    ]
    a = boot["after_ts"]["csm"]
    checks.append(
        (
            f"after TS, ECE {_pm(csm['after_ts.ece'])} vs ce + TS {_pm(ce['after_ts.ece'])}, "
            f"ΔECE interval {_ci(a)} (goal: no worse, the interval reaches 0)",
            a["ci95"][0] <= 0,
        )
    )
    if boot_nll:
        n = boot_nll["after_ts"]["csm"]
        checks.append(
            (
                f"after TS, NLL {_pm(csm['after_ts.nll'], 4)} vs ce + TS "
                f"{_pm(ce['after_ts.nll'], 4)}, ΔNLL interval {_ci(n, 4)} (goal: no worse)",
                n["ci95"][0] <= 0,
            )
        )
    if kway and "csm3" in kway["before_ts"]:
        k = kway["before_ts"]["csm3"]
        checks.append(
            (
                f"csm3 - csm ΔECE {k['difference']:+.2f}, interval {_ci(k)} (goal: not worse)",
                k["ci95"][0] <= 0,
            )
        )
    lines = ["## The goals (csm vs ce)", ""]
    lines += [f"- {text}: **{'yes' if ok else 'no'}**" for text, ok in checks]
    reached = all(ok for _, ok in checks)
    return [*lines, f"- **{'all reached' if reached else 'not reached'}**", ""]


def _tuning(tuning: dict) -> list[str]:
    """CSM's w and s per grid, chosen on val (lowest val NLL at the best-val-accuracy epoch)."""
    lines = [
        "## CSM's w and s, chosen on the val split",
        "",
        "Each grid point is a csm run with seed 100 (no study seed); its score is read at its "
        "best-val-accuracy epoch; the lowest val NLL wins. The test split is not read.",
        "",
        "| grid | run | w | s | val top-1 | val ECE | val NLL | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group, result in tuning.items():
        chosen = result["chosen"]
        for r in result["grid"]:
            pick = r["csm_sharpening"] == chosen["csm_sharpening"] and (
                r["csm_weight"] == chosen["csm_weight"]
            )
            w = "csm's" if r["csm_weight"] is None else f"{r['csm_weight']:g}"
            lines.append(
                f"| {group} | {r['run']} | {w} | {r['csm_sharpening']:g} | {r['val_acc']:.2f} | "
                f"{r['val_ece']:.2f} | {r['val_nll']:.4f} | {'**chosen**' if pick else ''} |"
            )
    return [*lines, ""]


def write_report(
    cfg: StudyConfig,
    root: Path,
    out: Path,
    records: list,
    summary: dict,
    boot: dict,
    kway: dict | None = None,
    boot_nll: dict | None = None,
    tuning: dict | None = None,
) -> Path:
    """study/report.md: the tables a reader needs to judge every method against ce.

    `boot` / `boot_nll`: {"before_ts"/"after_ts": {method: bootstrap of its ECE / NLL minus
    ce's}}. `kway`: {"images": {mixed folder: generated images}, "before_ts"/"after_ts": the
    bootstrap of each other mixed set's method against csm}. `tuning`: {group: the val grid and
    its choice} (pipeline/study_tune.py)."""
    n_seeds = len(cfg.seeds)
    lines = [
        f"# Study: {root.name}",
        "",
        f"{len(cfg.methods)} methods x {n_seeds} seeds ({', '.join(map(str, cfg.seeds))}); test "
        f"split; mean ± std (sample std) over seeds; percentages x100 except NLL and Brier. "
        f"Temperature scaling fitted on the val split (criterion `{cfg.ts_criterion}`).",
        "",
    ]
    for when, title in (
        ("before_ts", "Before temperature scaling"),
        ("after_ts", "After temperature scaling"),
    ):
        t_col = " T |" if when == "after_ts" else ""
        lines += [
            f"## {title}",
            "",
            "| method | " + " | ".join(c[1] for c in COLUMNS) + " |" + t_col,
            "|---|" + "---|" * len(COLUMNS) + ("---|" if t_col else ""),
        ]
        for method, stats in summary.items():
            cells = [_pm(stats[f"{when}.{k}"], d) for k, _, d in COLUMNS]
            if t_col:
                cells.append(_pm(stats["temperature"], 2))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## ECE difference to ce (x100), bootstrap 95 % interval",
        "",
        f"{cfg.bootstrap} resamples of the test images (paired across runs) and of the seeds "
        "(per method); the difference of mean-over-seeds ECE. An interval below 0 means the "
        "method is better calibrated than ce beyond test-set and seed noise.",
        "",
        "| method | ΔECE before TS | 95 % interval | relative | ΔECE after TS | 95 % interval |"
        + (" ΔNLL after TS | 95 % interval |" if boot_nll else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if boot_nll else ""),
    ]
    for method in summary:
        if method == "ce":
            continue
        b, a = boot["before_ts"][method], boot["after_ts"][method]
        row = (
            f"| {method} | {b['difference']:+.2f} | {_ci(b)} | {100 * b['relative']:+.0f} % | "
            f"{a['difference']:+.2f} | {_ci(a)} |"
        )
        if boot_nll:
            n = boot_nll["after_ts"][method]
            row += f" {n['difference']:+.4f} | {_ci(n, 4)} |"
        lines.append(row)
    lines.append("")
    if "csm" in summary:
        lines += _goal(summary, boot, boot_nll, kway)
    if tuning:
        lines += _tuning(tuning)
    if kway:
        lines += [
            "## Other mixed sets vs csm (x100), bootstrap 95 % interval",
            "",
            "csm<k>: k-way series given csm's image budget; csm-redraw: csm's plan with the "
            "series whose pure images the encoder rejects redrawn. Generated images per mixed "
            "set: "
            + ", ".join(f"`{k}` {v}" for k, v in kway["images"].items())
            + ". A negative difference: the method is better calibrated than csm.",
            "",
            "| method | top-1 | ΔECE before TS | 95 % interval | ΔECE after TS | 95 % interval |",
            "|---|---|---|---|---|---|",
        ]
        for method, b in kway["before_ts"].items():
            a, s = kway["after_ts"][method], summary[method]
            lines.append(
                f"| {method} | {_pm(s['before_ts.top1'])} | {b['difference']:+.2f} | "
                f"[{b['ci95'][0]:+.2f}, {b['ci95'][1]:+.2f}] | {a['difference']:+.2f} | "
                f"[{a['ci95'][0]:+.2f}, {a['ci95'][1]:+.2f}] |"
            )
        lines.append("")
    lines += [
        "## Every run",
        "",
        "| run | seed | top-1 | ECE | NLL | T | ECE after TS |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        edge = " (edge!)" if r["temperature_on_edge"] else ""
        lines.append(
            f"| {r['run']} | {r['seed']} | {r['before_ts']['top1']:.2f} | {r['before_ts']['ece']:.2f} | "
            f"{r['before_ts']['nll']:.4f} | {r['temperature']:.2f}{edge} | {r['after_ts']['ece']:.2f} |"
        )
    lines += ["", "Figures: [reliability.png](reliability.png), [ece.png](ece.png).", ""]
    path = out / "report.md"
    atomic_write_bytes(path, "\n".join(lines).encode())
    return path


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
        title=f"{root.name}: ECE per method, mean ± std over {len(cfg.seeds)} seeds",
    )
