"""eval/report.md: every complete evaluation under runs/<classes>/eval/ side by side.

Part of the evaluate stage (its summary output), kept apart so that stages/evaluate/stage.py reads as
the evaluation itself. The report is a view, not a finished output: its bytes are a function of
the complete evaluation folders on disk (each checked against its manifest), it lives inside
evaluate's own folder `eval/`, it is rewritten (temp file + rename) only when those bytes
change, and it is never written into a run folder or any other stage's folder.

Also here: which runs are internal (`internal_runs`: the classifiers the stages used as tools,
the study's tuning runs), which a bare evaluate and the report leave out unless asked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.codec import CONFIG_JSON, load
from core.io import atomic_write_bytes
from core.logs import log
from core.tables import table
from models.posthoc import POSTHOC
from shards import evals
from shards.manifest import ShardError
from stages.configs.annotate import Config as AnnotateConfig
from stages.configs.evaluate import Config
from stages.configs.fit_generator import Config as FitGeneratorConfig
from stages.configs.generate import Config as GenerateConfig

ENSEMBLE = "ensemble"
STAGE_FOLDERS = ("train", "finetune", ENSEMBLE)  # report order

REPORT_COLUMNS = [
    ("top1", "top-1", 2),
    ("top5", "top-5", 2),
    ("nll", "NLL", 4),
    ("brier", "Brier", 4),
    ("ece", "ECE", 2),
    ("aece", "AECE", 2),
    ("mce", "MCE", 2),
    ("classwise_ece", "cw-ECE", 3),
    ("oece", "O-ECE", 2),
    ("uece", "U-ECE", 2),
]
# Beside ECE (docs/evaluate.md): smooth, debiased and l2 calibration errors, selective risk.
MORE_COLUMNS = [
    ("smece", "smECE"),
    ("debiased_ece", "debiased ECE"),
    ("l2_ece", "l2-ECE"),
    ("classwise_l2_ece", "cw-l2-ECE"),
    ("aurc", "AURC"),
    ("augrc", "AUGRC"),
    ("risk_at_80", "risk@80"),
]
SEED_RUN = re.compile(r"^(?P<pre>.+?)-s(?P<seed>\d+)(?P<post>-.+)?$")  # e.g. csm-s2, ce-s0-maccal
SUMMARY_COLUMNS = [
    ("top1", "before_ts"),
    ("ece", "before_ts"),
    ("nll", "before_ts"),
    ("ece", "after_ts"),
]
SEVERITIES = [f"s{i}" for i in range(1, 6)]  # the corruption tables' columns
OOD_HEADINGS = [
    "run", "stage", "OOD set", "MSP AUROC", "FPR95", "entropy AUROC", "MSP AUROC after TS",
    "MSP AUPR-in / out", "max-logit AUROC", "energy AUROC",
]  # fmt: skip


# The study's grid of csm runs that choose w and s on val (pipeline/study/tuning.py).
INTERNAL_PREFIXES = ("tune-",)


def internal_runs(root: Path) -> set[str]:
    """Names of the train runs the stages under `root` used as tools, as their recorded configs
    name them (core.codec.load): annotate's encoder (encoder=classifier) and fidelity judge
    (mixed/), the endpoint judge of generate (series/) and the judge of fit-generator
    (generator/). In the digits and fashion-mnist chains: `encoder` and `judge`. Runs named
    tune-* (the study's tuning grid) are internal too (`is_internal`)."""
    roles: dict[str, tuple[type, Callable[[Any], list[str]]]] = {
        "mixed": (
            AnnotateConfig,
            lambda c: [c.judge, c.encoder.classifier.run if c.encoder.name == "classifier" else ""],
        ),
        "series": (GenerateConfig, lambda c: [c.endpoint.judge]),
        "generator": (FitGeneratorConfig, lambda c: [c.fidelity.judge]),
    }
    names: set[str] = set()
    for folder, (config_cls, used) in roles.items():
        if (Path(root) / folder / CONFIG_JSON).is_file():
            names.update(n for n in used(load(config_cls, Path(root) / folder)) if n)
    return names


def is_internal(name: str, internal: set[str]) -> bool:
    return name in internal or name.startswith(INTERNAL_PREFIXES)


def left_out(cfg: Config) -> Callable[[str], bool]:
    """Which run names `make evaluate` skips and report.md leaves out (none with internal_runs)."""
    if cfg.internal_runs:
        return lambda name: False
    internal = internal_runs(cfg.root)
    return lambda name: is_internal(name, internal)


def seed_summary(rows: list[tuple[str, str, dict]]) -> list[str]:
    """Mean ± std (sample std) over runs that differ only in their `-s<seed>` part."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for stage, name, ev in rows:
        m = SEED_RUN.match(name)
        if m:
            groups.setdefault((stage, m["pre"] + (m["post"] or "")), []).append(ev)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return []
    lines_ = [
        "## Mean ± std over seeds",
        "",
        "Runs named `<name>-s<seed>[-<method>]`, grouped by everything but the seed.",
        "",
    ]
    table_rows = []
    for (stage, name), evs in sorted(groups.items()):
        cells = []
        for metric, when in SUMMARY_COLUMNS:
            v = np.array([ev[when][metric] for ev in evs], dtype=float)
            digits = 3 if metric == "nll" else 2
            cells.append(f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}")
        table_rows.append([name, stage, str(len(evs)), *cells])
    headings = ("runs", "stage", "n", "top-1", "ECE", "NLL", "ECE after TS")
    return [*lines_, *table(headings, table_rows), ""]


def collect_rows(
    root: Path, leave_out: Callable[[str], bool] = lambda name: False
) -> tuple[list[tuple[str, str, dict[str, Any]]], list[str]]:
    """((stage, run, evaluation) of every complete, undamaged evaluation, in report order;
    the names of the train/finetune runs `leave_out` took away)."""
    rows, left = [], []
    for stage, name, folder in evals.evaluated(root, STAGE_FOLDERS):
        if stage != ENSEMBLE and leave_out(name):
            left.append(name)
            continue
        try:
            metrics = evals.read_metrics(folder)
        except ShardError as e:  # one damaged folder must not hide every other evaluation
            log.warning("report.md: left out %s (%s)", folder, e)
            continue
        if metrics:
            rows.append((stage, name, metrics["evaluation"]))
    return rows, sorted(set(left))


def render(
    title: str, rows: list[tuple[str, str, dict[str, Any]]], left_out: Sequence[str] = ()
) -> str:
    lines_ = [
        f"# {title}: evaluated runs",
        "",
        "Test split; percentages x100 except NLL and Brier. "
        "Temperature T fitted on the val split (criterion `nll`: the val-NLL minimiser in "
        "[0.05, 20]; `ece`: the lowest val ECE on 0.1..10). T on the edge of its "
        "range (marked !) means a degenerate fit.",
        "",
    ]
    if left_out:
        lines_ += [
            f"Left out: the internal run(s) {', '.join(left_out)} (a classifier the stages "
            "used as a tool, e.g. annotate's encoder or a fidelity judge, or a study tuning "
            "run); evaluate with `--set internal_runs=1` lists them.",
            "",
        ]
    for key, heading in (
        ("before_ts", "Before temperature scaling"),
        ("after_ts", "After temperature scaling"),
    ):
        after = key == "after_ts"
        headings = [
            "run",
            "stage",
            "loss",
            *(c[1] for c in REPORT_COLUMNS),
            *(["T"] if after else []),
        ]
        cells = []
        for stage, name, ev in rows:
            edge = "!" if ev.get("temperature_on_edge") else ""
            t = [f"{ev['temperature']:.2f}{edge}"] if after else []
            metrics = [f"{ev[key][c]:.{d}f}" for c, _, d in REPORT_COLUMNS]
            cells.append([name, stage, ev.get("loss", "") or "-", *metrics, *t])
        lines_ += [f"## {heading}", "", *table(headings, cells), ""]
    lines_ += more_metrics(rows) + posthoc_table(rows) + seed_summary(rows)
    ood = [(s, n, ev) for s, n, ev in rows if "ood" in ev]
    if ood:
        lines_ += [
            "## OOD detection (ID = positive)",
            "",
        ]
        cells = []
        for s, n, ev in ood:
            for set_name, section in ev["ood"].items():
                b, a = section["before_ts"], section["after_ts"]
                aupr = f"{_cell(b, 'msp_aupr_in')} / {_cell(b, 'msp_aupr_out')}"
                cells.append([
                    n, s, set_name, f"{b['msp_auroc']:.2f}", f"{b['msp_fpr95']:.2f}",
                    f"{b['entropy_auroc']:.2f}", f"{a['msp_auroc']:.2f}", aupr,
                    _cell(b, "maxlogit_auroc"), _cell(b, "energy_auroc"),
                ])  # fmt: skip
        lines_ += [*table(OOD_HEADINGS, cells), ""]
    corr = [(s, n, ev) for s, n, ev in rows if "corruptions" in ev]
    if corr:
        lines_ += [
            "## Corruptions: mean ECE per severity (before / after TS)",
            "",
        ]
        severities = []
        for s, n, ev in corr:
            b, a = ev["corruptions"]["before_ts"]["mean"], ev["corruptions"]["after_ts"]["mean"]
            cells = [f"{b[str(i)]['ece']:.2f} / {a[str(i)]['ece']:.2f}" for i in range(1, 6)]
            severities.append([n, s, *cells])
        lines_ += [*table(["run", "stage", *SEVERITIES], severities), ""]
        lines_ += corruption_nll(corr)
    return "\n".join(lines_)


def _cell(metrics: dict[str, Any], key: str, digits: int = 2) -> str:
    """One number, or "-" where the evaluation did not record it."""
    return f"{metrics[key]:.{digits}f}" if key in metrics else "-"


def more_metrics(rows: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Smooth/debiased/l2 calibration errors and selective risk, before / after TS."""
    rows = [r for r in rows if "smece" in r[2]["before_ts"]]
    if not rows:
        return []
    lines_ = [
        "## More metrics (before / after TS)",
        "",
        "smECE: smooth ECE (relplot); debiased ECE: debiased l2 top-label error; l2-ECE, "
        "cw-l2-ECE: plug-in l2 top-label and classwise errors; AURC, AUGRC: areas under the "
        "(generalised) risk-coverage curve; risk@80: error of the 80 % most confident. All x100.",
        "",
    ]
    table_rows = []
    for stage, name, ev in rows:
        b, a = ev["before_ts"], ev["after_ts"]
        cells = [f"{_cell(b, k)} / {_cell(a, k)}" for k, _ in MORE_COLUMNS]
        table_rows.append([name, stage, *cells])
    headings = ["run", "stage", *(c[1] for c in MORE_COLUMNS)]
    return [*lines_, *table(headings, table_rows), ""]


def posthoc_table(rows: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Test NLL / ECE after each post-hoc calibrator; the one chosen on val marked *."""
    rows = [r for r in rows if "posthoc" in r[2]]
    if not rows:
        return []
    seen = {m for r in rows for m in r[2]["posthoc"]["after"]}
    calibrators = [m for m in POSTHOC if m in seen] + sorted(seen - set(POSTHOC))  # registry order
    lines_ = [
        "## Post-hoc calibrators (fitted on val): test NLL / ECE",
        "",
        f"* = the best by {rows[0][2]['posthoc']['criterion']} (models/posthoc.py).",
        "",
    ]
    table_rows = []
    for stage, name, ev in rows:
        after, best = ev["posthoc"]["after"], ev["posthoc"]["best"]
        cells = [
            f"{after[m]['nll']:.4f} / {after[m]['ece']:.2f}{'*' if m == best else ''}"
            if m in after
            else "-"
            for m in calibrators
        ]
        table_rows.append([name, stage, *cells])
    return [*lines_, *table(["run", "stage", *calibrators], table_rows), ""]


def corruption_nll(corr: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Mean NLL per severity, before / after TS / after the best post-hoc calibrator."""
    corr = [r for r in corr if "after_posthoc" in r[2]["corruptions"]]
    if not corr:
        return []
    lines_ = [
        "## Corruptions: mean NLL per severity (before / after TS / after the best post-hoc)",
        "",
    ]
    table_rows = []
    for s, n, ev in corr:
        c = ev["corruptions"]
        b, a, p = (c[w]["mean"] for w in ("before_ts", "after_ts", "after_posthoc"))
        cells = [" / ".join(f"{m[str(i)]['nll']:.3f}" for m in (b, a, p)) for i in range(1, 6)]
        table_rows.append([n, s, c["posthoc_method"], *cells])
    return [*lines_, *table(["run", "stage", "post-hoc", *SEVERITIES], table_rows), ""]


def write_report(root: Path, leave_out: Callable[[str], bool] = lambda name: False) -> Path:
    """Rebuild eval/report.md from disk, without the runs `leave_out` names (internal runs:
    stages.evaluate.report.left_out); untouched when its bytes would not change (so a rerun that
    evaluates nothing new writes nothing)."""
    path = evals.report_path(root)
    data = render(Path(root).name, *collect_rows(root, leave_out)).encode()
    if not (path.is_file() and path.read_bytes() == data):
        atomic_write_bytes(path, data, shared=True)  # parallel evaluations rebuild it
    return path
