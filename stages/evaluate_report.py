"""eval/report.md: every complete evaluation under runs/<classes>/eval/ side by side.

Part of the evaluate stage (its summary output), kept apart so that stages/evaluate.py reads as
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

from core.io import atomic_write_bytes, read_json
from core.logs import log
from shards import evals
from shards.manifest import ShardError
from stages.configs.evaluate import Config

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
SEED_RUN = re.compile(r"^(?P<pre>.+?)-s(?P<seed>\d+)(?P<post>-.+)?$")  # e.g. csm-s2, ce-s0-maccal
SUMMARY_COLUMNS = [
    ("top1", "before_ts"),
    ("ece", "before_ts"),
    ("nll", "before_ts"),
    ("ece", "after_ts"),
]


# The study's grid of csm runs that choose w and s on val (pipeline/study_tune.py).
INTERNAL_PREFIXES = ("tune-",)


def internal_runs(root: Path) -> set[str]:
    """Names of the train runs the stages under `root` used as tools, as their config.json files
    record them: annotate's encoder (encoder=classifier) and fidelity judge (mixed/), the
    endpoint judge of generate (series/) and the judge of fit-generator (generator/). In the
    digits and fashion-mnist chains: `encoder` and `judge`. Runs named tune-* (the study's
    tuning grid) are internal too (`is_internal`)."""
    roles = {
        "mixed": lambda c: (
            [c.get("fidelity_run", "")]
            + ([c.get("encoder_run", "")] if c.get("encoder") == "classifier" else [])
        ),
        "series": lambda c: [c.get("endpoint_judge", "")],
        "generator": lambda c: [c.get("judge_run", "")],
    }
    names: set[str] = set()
    for folder, used in roles.items():
        path = Path(root) / folder / "config.json"
        if path.is_file():
            names.update(n for n in used(read_json(path)) if n)
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
        "| runs | stage | n | top-1 | ECE | NLL | ECE after TS |",
        "|---|---|---|---|---|---|---|",
    ]
    for (stage, name), evs in sorted(groups.items()):
        cells = []
        for metric, when in SUMMARY_COLUMNS:
            v = np.array([ev[when][metric] for ev in evs], dtype=float)
            digits = 3 if metric == "nll" else 2
            cells.append(f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}")
        lines_.append(f"| {name} | {stage} | {len(evs)} | " + " | ".join(cells) + " |")
    return [*lines_, ""]


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
    head = "| run | stage | loss | " + " | ".join(c[1] for c in REPORT_COLUMNS)
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
            "run); `make evaluate SET=internal_runs=1` lists them.",
            "",
        ]
    for key, heading in (
        ("before_ts", "Before temperature scaling"),
        ("after_ts", "After temperature scaling"),
    ):
        extra = " | T |" if key == "after_ts" else " |"
        lines_ += [
            f"## {heading}",
            "",
            head + extra,
            "|" + "---|" * (len(REPORT_COLUMNS) + 3 + (key == "after_ts")),
        ]
        for stage, name, ev in rows:
            cells = [f"{ev[key][c]:.{d}f}" for c, _, d in REPORT_COLUMNS]
            edge = "!" if ev.get("temperature_on_edge") else ""
            t = [f"{ev['temperature']:.2f}{edge}"] if key == "after_ts" else []
            lines_.append(
                "| " + " | ".join([name, stage, ev.get("loss", "") or "-", *cells, *t]) + " |"
            )
        lines_.append("")
    lines_ += seed_summary(rows)
    ood = [(s, n, ev) for s, n, ev in rows if "ood" in ev]
    if ood:
        lines_ += [
            "## OOD detection (ID = positive)",
            "",
            "| run | stage | OOD set | MSP AUROC | FPR95 | entropy AUROC | MSP AUROC after TS |",
            "|---|---|---|---|---|---|---|",
        ]
        for s, n, ev in ood:
            b, a = ev["ood"]["before_ts"], ev["ood"]["after_ts"]
            lines_.append(
                f"| {n} | {s} | {ev['ood']['set']} | {b['msp_auroc']:.2f} | {b['msp_fpr95']:.2f} "
                f"| {b['entropy_auroc']:.2f} | {a['msp_auroc']:.2f} |"
            )
        lines_.append("")
    corr = [(s, n, ev) for s, n, ev in rows if "corruptions" in ev]
    if corr:
        lines_ += [
            "## Corruptions: mean ECE per severity (before / after TS)",
            "",
            "| run | stage | " + " | ".join(f"s{i}" for i in range(1, 6)) + " |",
            "|---|---|" + "---|" * 5,
        ]
        for s, n, ev in corr:
            b, a = ev["corruptions"]["before_ts"]["mean"], ev["corruptions"]["after_ts"]["mean"]
            cells = [f"{b[str(i)]['ece']:.2f} / {a[str(i)]['ece']:.2f}" for i in range(1, 6)]
            lines_.append(f"| {n} | {s} | " + " | ".join(cells) + " |")
        lines_.append("")
    return "\n".join(lines_)


def write_report(root: Path, leave_out: Callable[[str], bool] = lambda name: False) -> Path:
    """Rebuild eval/report.md from disk, without the runs `leave_out` names (internal runs:
    stages.evaluate.left_out); untouched when its bytes would not change (so a rerun that
    evaluates nothing new writes nothing)."""
    path = evals.report_path(root)
    data = render(Path(root).name, *collect_rows(root, leave_out)).encode()
    if not (path.is_file() and path.read_bytes() == data):
        atomic_write_bytes(path, data)
    return path
