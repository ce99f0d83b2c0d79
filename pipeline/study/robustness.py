"""`make study`'s robustness table: every study run evaluated under shift (the corrupted test
split of the `shift` stage, 5 severities) and on far-OOD sets (the `ood` stage), with the
comparisons paired by seed and by test image as in the main table.

The study plans two more tasks before its runs' evaluations, `shift` (the first SHIFT_IMAGES test
images under every corruption and severity) and `ood` (OOD_SETS), and each run's evaluate step
reads them (`corruptions=`, `ood=`). A run whose evaluation did not read them is evaluated again
(its training is kept). Each record of study.json carries

    shift: {before_ts|after_ts: {"1".."5": {ece, nll, brier, top1}},   the mean over corruptions
            per_corruption: {before_ts|after_ts: {corruption: {"1".."5": {...}}}}}
    ood:   {<set>: {auroc, fpr95, aupr_in, aupr_out, auroc_after_ts}}  (max-softmax score)

and study.json's `shift_paired` holds the paired bootstrap of the mean over corruptions and
severities SEVERE of ECE and NLL (the logits evaluate keeps in predictions.npz), each method
against ce, before and after TS, with the margins of the main table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.seeding import derive_seed
from core.tables import table
from pipeline.chain import split_sets
from pipeline.study.config import Task
from pipeline.study.intervals import mixed_sets_of
from pipeline.study.stats import MARGINS, N_BINS, Predictions, paired_difference, softmax
from shards import evals
from shards.manifest import is_complete, read_manifest

SHIFT_IMAGES = 2000  # test images under each corruption and severity (x 5 x 11 per run)
SEVERE = (3, 4, 5)  # the severities the verdict reads (MaC-Cal's Fig. 5 separates methods there)
OOD_SETS = ("digits", "uniform")  # a far-OOD set of real images and a synthetic one
SHIFT_METRICS = ("ece", "nll")
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


def shift_folder(root: Path) -> Path:
    return root / "shift" / "test-c"


def ood_sets(preset: str) -> tuple[str, ...]:
    """The OOD sets of a root: scikit-learn's digits is no OOD set for the digits data (the
    digits preset, or digits+<recipe>: the data is the part before the +)."""
    data = preset.partition("+")[0]
    return tuple(s for s in OOD_SETS if not (s == "digits" and data == "digits"))


def robustness_tasks(
    root: Path, preset: str, after: set[str], study_sets: Sequence[str] = ()
) -> tuple[list[Task], list[str]]:
    """(the shift and ood tasks, the --set values that make evaluate read them); `study_sets`:
    the study's command line, whose shared keys (out=, name=) and `shift.` / `ood.` keys reach
    the two stages."""
    sets = ood_sets(preset)
    tasks = [
        Task(
            "shift",
            [("shift", [*split_sets(study_sets, "shift"), f"limit={SHIFT_IMAGES}"])],
            set(after),
            is_complete(shift_folder(root)),
        ),
        Task(
            "ood",
            [("ood", [*split_sets(study_sets, "ood"), f"sets={','.join(sets)}"])],
            set(after),
            all(is_complete(root / "ood" / s) for s in sets),
        ),
    ]
    evaluate = [
        f"corruptions={shift_folder(root)}",
        "ood=" + ",".join(str(root / "ood" / s) for s in sets),
    ]
    return tasks, evaluate


def read_them(folder: Path, preset: str) -> bool:
    """The evaluation in `folder` read the shift and OOD sets (its manifest's upstream)."""
    manifest = read_manifest(folder)
    upstream, settings = manifest.upstream, manifest.info.get("settings", {})
    return (
        "corruptions" in upstream
        and all(f"ood/{s}" in upstream for s in ood_sets(preset))
        and settings.get("predictions_format") == evals.PREDICTIONS_FORMAT  # has the OOD logits
    )


def record(ev: dict[str, Any]) -> dict[str, Any]:
    """The `shift` and `ood` entries of a study record, from an evaluation's metrics."""
    corr = ev["corruptions"]
    shift = {when: corr[when]["mean"] for when in ("before_ts", "after_ts")}
    shift["per_corruption"] = {
        when: {c: v for c, v in corr[when].items() if c != "mean"}
        for when in ("before_ts", "after_ts")
    }
    ood = {
        name: {
            "auroc": s["before_ts"]["msp_auroc"],
            "fpr95": s["before_ts"]["msp_fpr95"],
            "aupr_in": s["before_ts"].get("msp_aupr_in"),
            "aupr_out": s["before_ts"].get("msp_aupr_out"),
            "auroc_after_ts": s["after_ts"]["msp_auroc"],
        }
        for name, s in ev.get("ood", {}).items()
    }
    return {"shift": shift, "ood": ood}


# ---------------------------------------------------------------- statistics paired by image


@dataclass(frozen=True)
class ShiftPredictions:
    """One run's predictions on the SEVERE corrupted sets (every corruption x severity, the
    same N test images in each): the metrics of pipeline.study.stats.Predictions, each the mean
    over the sets, on the images `idx` of every set at once."""

    bins: np.ndarray  # [K, N] confidence bin of each image in each set
    gap: np.ndarray  # [K, N] 1[correct] − confidence
    nlls: np.ndarray  # [K, N]
    labels: np.ndarray  # [N]

    @classmethod
    def load(cls, path: Path, temperature: float) -> ShiftPredictions:
        with np.load(path, allow_pickle=False) as z:
            logits, labels = z["corruption_logits"], z["corruption_labels"]
        sets = logits[:, [s - 1 for s in SEVERE]].reshape(-1, *logits.shape[2:])
        preds = [Predictions.from_logits(lg, labels, temperature) for lg in sets]
        return cls(
            *(np.stack([getattr(p, f) for p in preds]) for f in ("bins", "gap", "nlls")), labels
        )

    def ece(self, idx: np.ndarray | None = None) -> float:
        bins, gap = (self.bins, self.gap) if idx is None else (self.bins[:, idx], self.gap[:, idx])
        k, n = gap.shape
        offset = (np.arange(k)[:, None] * N_BINS + bins).ravel()  # one bincount for all sets
        sums = np.bincount(offset, weights=gap.ravel(), minlength=k * N_BINS).reshape(k, N_BINS)
        return float(np.abs(sums).sum() / (k * n))

    def nll(self, idx: np.ndarray | None = None) -> float:
        return float((self.nlls if idx is None else self.nlls[:, idx]).mean())


@dataclass(frozen=True)
class OODPredictions:
    """One run's max-softmax scores (before TS) on the test split and one OOD set, as one
    sample of N_test + N_ood images (ID first) that the paired bootstrap resamples like test
    images: every run scores the same images in the same order. `auroc_shortfall(idx)` is
    1 − AUROC (ID = positive, ties counted half) on the images `idx`, counted with their
    multiplicity, in O(N) from tie groups sorted once."""

    group: np.ndarray  # [N] rank of each image's score among the distinct scores (ascending)
    is_id: np.ndarray  # [N] 1.0 for a test image, 0.0 for an OOD one
    labels: np.ndarray  # [N] test labels, then −1 for the OOD images (pairing check only)

    @classmethod
    def load(cls, path: Path, ood_set: str) -> OODPredictions:
        with np.load(path, allow_pickle=False) as z:
            test, ood, labels = z["logits"], z[evals.ood_logits_key(ood_set)], z["labels"]
        scores = np.concatenate([softmax(test).max(axis=1), softmax(ood).max(axis=1)])
        _, group = np.unique(scores, return_inverse=True)
        is_id = np.concatenate([np.ones(len(test)), np.zeros(len(ood))])
        return cls(group, is_id, np.concatenate([labels, np.full(len(ood), -1)]))

    def auroc_shortfall(self, idx: np.ndarray | None = None) -> float:
        n = len(self.group)
        w = np.ones(n) if idx is None else np.bincount(idx, minlength=n).astype(float)
        g = int(self.group.max()) + 1
        pos = np.bincount(self.group, weights=w * self.is_id, minlength=g)
        neg = np.bincount(self.group, weights=w * (1.0 - self.is_id), minlength=g)
        below = np.cumsum(neg) - neg  # OOD weight strictly below each score
        auroc = float(pos @ (below + 0.5 * neg)) / float(pos.sum() * neg.sum())
        return 1.0 - auroc


def ood_paired(
    root: Path,
    records: list[dict[str, Any]],
    methods: Sequence[str],
    n: int,
    rng: Callable[..., np.random.Generator],
) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {method: paired_difference}} of 1 − AUROC (max softmax, before TS), each method
    against ce on each OOD set, paired by seed and by image (test and OOD images resampled
    together); `rng("ood", set, method, "ce")` as the other comparisons'."""
    sets = list(dict.fromkeys(s for r in records for s in r.get("ood", {})))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ood_set in sets:
        runs: dict[str, dict[int, OODPredictions]] = {}
        for r in records:
            path = root / evals.EVAL / r["run"] / evals.PREDICTIONS
            runs.setdefault(r["method"], {})[r["seed"]] = OODPredictions.load(path, ood_set)
        for m in methods:
            if m != "ce" and m in runs and "ce" in runs:
                g = rng("ood", ood_set, m, "ce")
                out.setdefault(ood_set, {})[m] = paired_difference(
                    runs,
                    m,
                    "ce",
                    n,
                    g,
                    "auroc_shortfall",  # type: ignore[arg-type]
                    mixed_sets=mixed_sets_of(records),
                )
    return out


def comparisons(methods: Sequence[str]) -> list[tuple[str, str, str, str]]:
    """(when, metric, method, reference): every method against ce after TS (ECE and NLL: the
    post-hoc fix is what shift undoes), and csm against ce before TS too."""
    out = [("after_ts", k, m, "ce") for m in methods if m != "ce" for k in SHIFT_METRICS]
    return out + ([("before_ts", "ece", "csm", "ce")] if "csm" in methods else [])


def rng(*key: str) -> np.random.Generator:
    """The generator of one comparison under shift: (when, metric, method, reference)."""
    return np.random.default_rng(derive_seed(0, "study-shift", *key))


def shift_paired(
    root: Path,
    records: list[dict[str, Any]],
    wanted: Sequence[tuple[str, str, str, str]],
    n: int,
    rng: Callable[..., np.random.Generator],
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{when: {metric: {reference: {method: paired_difference}}}} on the SEVERE sets for each
    (when, metric, method, reference) of `wanted`; `rng(when, metric, method, reference)` as
    the main table's."""
    runs: dict[str, dict[str, dict[int, ShiftPredictions]]] = {"before_ts": {}, "after_ts": {}}
    for r in records:
        path = root / evals.EVAL / r["run"] / evals.PREDICTIONS
        for when, t in (("before_ts", 1.0), ("after_ts", r["temperature"])):
            runs[when].setdefault(r["method"], {})[r["seed"]] = ShiftPredictions.load(path, t)
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for when, metric, method, reference in wanted:
        g = rng(when, metric, method, reference)
        mixed = mixed_sets_of(records)
        result = paired_difference(runs[when], method, reference, n, g, metric, mixed_sets=mixed)  # type: ignore[arg-type]
        out.setdefault(when, {}).setdefault(metric, {}).setdefault(reference, {})[method] = result
    return out


# ---------------------------------------------------------------- report and figure


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


def figure(records: list[dict[str, Any]], path: Path, title: str) -> Path:
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
