"""The `semix study` command: the plan run, then study.json, report.md and the figures; and the
command's --fields and --print-config (pipeline/study/__init__.py says what a study does)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.fielddocs import describe_fields
from core.io import atomic_write_json
from core.logs import log
from core.seeding import derive_seed
from pipeline.chain import chain_fields
from pipeline.study.cells import CELL_FIT, choose_cell, reference_steps
from pipeline.study.config import (
    METHODS,
    METRICS,
    POSTHOC,
    StudyConfig,
    check_budget,
    comparison_pairs,
)
from pipeline.study.estimate import estimate, measured_line
from pipeline.study.execute import Sitting, code_version, execute
from pipeline.study.figures import fidelity_figure, figures, shift_figure
from pipeline.study.intervals import mixed_sets_of
from pipeline.study.mixed_sets import mixed_images, set_variant, variant_root
from pipeline.study.plan import setup, study_cells
from pipeline.study.protocol import lock, record
from pipeline.study.records import collect, seed_predictions
from pipeline.study.report import write_report
from pipeline.study.robustness_stats import comparisons, ood_paired, shift_paired, shift_rng
from pipeline.study.schedule import remaining_path
from pipeline.study.stats import MARGINS, compare, summarize
from pipeline.study.time_left import TimeLeft
from pipeline.study.tuning import tune_seeds
from pipeline.study.tuning_plan import configurations, tuning_report
from stages.common.budget import labelled_split_images

RUNS = ("train", "finetune", "evaluate")  # the stages a study runs after the chain


def pair_rng(*key: str) -> np.random.Generator:
    """The generator of one paired comparison: (when, metric, method, reference)."""
    return np.random.default_rng(derive_seed(0, "study-paired", *key))


def run_study(preset: str, sets: Sequence[str]) -> Path:
    # 0. The study's config, the run root, and the plan, every run's config resolved.
    cfg, root, tasks = setup(preset, sets)
    out = root / "study"
    # 1-2. The chain and every run (skipping what is complete).
    todo = [t.name for t in tasks if not t.done]
    log.info(
        "study %s: %d methods x %d seeds, %d of %d tasks to run, %d at a time -> %s",
        *(root.name, len(cfg.methods), len(cfg.seeds), len(todo), len(tasks), cfg.jobs, out),
    )
    out.mkdir(parents=True, exist_ok=True)
    # the protocol as the study starts with it, before its first task: a later edit shows
    lock(out, cfg.protocol, code_version())
    sitting = Sitting(out / "host.json")
    # the plan's expected wall before the first task (pipeline/study/estimate.py), its
    # critical-path priorities the order ready tasks start in; host.json keeps it beside the
    # sitting's measured wall. Its rates are another machine's when it says so: the progress
    # line's time left then rescales each kind by what its finished tasks took here (TimeLeft)
    plan_estimate = estimate(tasks, preset, cfg.jobs, root)
    log.info("study: the estimate of this sitting's plan\n%s", plan_estimate.table())
    sitting.estimate = plan_estimate.record()
    priority = remaining_path(tasks, plan_estimate.seconds)
    time_left = TimeLeft(tasks, plan_estimate, priority).line
    seconds = execute(
        tasks, preset, cfg.jobs, out / "logs", sitting.write, priority, time_left=time_left
    )
    # 3. Records, statistics, report and figures.
    records = collect(cfg, root)
    budget = check_budget(records)
    summary = summarize(records, METRICS)
    by_seed = seed_predictions(root, records)
    # paired by seed and test image (mixed sets the top-level units where records carry them),
    # the intervals of pipeline/study/intervals.py, verdicts against the margins fixed in
    # pipeline/study/endpoints.py (MARGINS) before any run
    pairs = comparison_pairs(cfg.methods)
    if POSTHOC in by_seed["after_ts"]:  # after TS only
        pairs += [(m, POSTHOC) for m in ("ce", "csm") if m in cfg.methods]
    paired = {
        when: compare(
            p,
            [pair for pair in pairs if POSTHOC not in pair or when == "after_ts"],
            cfg.bootstrap,
            functools.partial(pair_rng, when),
            mixed_sets=mixed_sets_of(records),
            when=when,
        )
        for when, p in by_seed.items()
    }
    robust: dict[str, Any] = {"shift": None, "ood": None}
    if cfg.robustness:
        wanted = comparisons(cfg.methods)
        robust = {
            "shift": shift_paired(root, records, wanted, cfg.bootstrap, shift_rng),
            "ood": ood_paired(root, records, cfg.methods, cfg.bootstrap, shift_rng),
        }
    tuning = tuning_report(cfg, root, sets) if cfg.tune else {}
    counts = configurations(cfg, tuning) if cfg.tune else None
    chain_sets = [s for s in sets if not s.startswith("study.")]
    cells = study_cells(cfg, preset, chain_sets) and choose_cell(
        root, tune_seeds(cfg), variant_root(root, CELL_FIT), reference_steps(preset, chain_sets)
    )
    variants = sorted(
        set_variant(METHODS[m].variant, cfg.mixed_set(m, seed), cfg.fit_of(m, seed))
        for m in cfg.methods
        if METHODS[m].needs_mixed
        for seed in cfg.seeds_of(m)
    )
    variants = [v for v in dict.fromkeys(variants) if v]
    images = mixed_images(root, variants) if variants else None
    atomic_write_json(
        out / "study.json",
        {
            "dataset": root.name,
            "protocol": record(out, cfg.protocol),
            "labelled_images": labelled_split_images(root, budget),
            "labelled_train_images": budget,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
            "records": records,
            "summary": summary,
            "paired": paired,
            "margins": MARGINS,
            "tuning": tuning,
            "configurations": counts,
            "generator": cells or None,
            "mixed_images": images,
            "shift_paired": robust["shift"],
            "ood_paired": robust["ood"],
        },
    )
    # what this machine took, apart: study.json is the same bytes wherever the study ran
    log.info(measured_line(plan_estimate.wall, sitting.wall()))
    sitting.write(seconds, finished=True)
    figures(cfg, root, out, {m: list(p.values()) for m, p in by_seed["before_ts"].items()}, summary)
    if cells:
        fidelity_figure(cells, out / "fidelity.png")
    report = write_report(
        cfg, root, out, records, summary, paired, tuning, images,
        robust if cfg.robustness else None, cells or None, record(out, cfg.protocol), counts,
    )  # fmt: skip
    if cfg.robustness:
        shift_figure(records, out / "shift.png", f"{root.name}: under corruption, after TS")
    return report


def fields_text(preset: str) -> str:
    """`semix study --fields`: the study's own fields (`study.key`), then the chain's and those
    of the runs it makes."""
    head = f"semix study --preset {preset}: the study, the chain, then train/finetune/evaluate runs"
    study = describe_fields(StudyConfig, spell=lambda key: f"study.{key}")
    return "\n".join(
        [head, "study: --set study.key=value", *study, "", *chain_fields(preset, RUNS)]
    )


def resolved(preset: str, sets: Sequence[str]) -> dict[str, Any]:
    """`semix study --print-config`: the study's config and its plan (every task, whether it is
    done, and the commands it runs); nothing runs, and the data need not be at hand."""
    cfg, root, tasks = setup(preset, sets, data=False)
    plan_estimate = estimate(tasks, preset, cfg.jobs, root)
    return {
        "study": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
        "root": str(root),
        "estimate": plan_estimate.record(),
        "tasks": [
            {
                "name": t.name,
                "done": t.done,
                "after": sorted(t.after),
                "expected_seconds": round(plan_estimate.seconds[t.name], 1),
                "steps": [{"stage": stage, "sets": list(s)} for stage, s in t.steps],
            }
            for t in tasks
        ],
    }


def estimate_text(preset: str, sets: Sequence[str]) -> str:
    """`semix study --estimate`: the plan's expected wall on this machine as a short table
    (pipeline/study/estimate.py); nothing runs, and the data need not be at hand."""
    cfg, root, tasks = setup(preset, sets, data=False)
    pending = sum(not t.done for t in tasks)
    head = f"semix study {root.name}: {pending} of {len(tasks)} tasks to run, {cfg.jobs} at a time"
    return head + "\n" + estimate(tasks, preset, cfg.jobs, root).table()


def main(preset: str, sets: Sequence[str]) -> None:
    """`python -m pipeline study`: run it, then print where the report is and its goal."""
    report = run_study(preset, sets)
    print(f"semix study: report in {report}")
    text = report.read_text()
    start = text.find("## The goal")
    if start >= 0:
        print(text[start:].split("\n## ", 1)[0])
