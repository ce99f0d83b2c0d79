"""How long a study's plan takes on this machine, before its first task: every task's expected
seconds from measured rates (one model per task kind), then the scheduler of execute.py
simulated over the plan (`jobs` at a time, the same dependencies, the same order, the same core
rule: pipeline.study.schedule), giving the expected wall and the critical path.

The rates are seconds per unit of work as a task of that kind took them *inside a study*, with
`jobs - 1` other tasks beside it on the same cores: what the scheduler sees. The committed
default (rates.json) is fitted from the verdict study's own host.json (docs/results/fashion-
verdict/, 2 jobs on 2 cores; `python -m pipeline.study.rates fit` remakes it and prints the
cross-check: pipeline/study/rates.py). A task's units come from its resolved config, so a plan
with more seeds, epochs, fit steps or images costs more without a new fit; another machine, or
another `jobs`, needs its own rates file (`--set` nothing: pass the file as SEMIX_STUDY_RATES).
A task that holds every core runs alone under the core rule, so its kind's `alone` rate
(measured alone, not fitted: the file's `alone_source` says where) replaces the study's for it.

The rates file names the machine its rates were measured on (`machine`, core.machine's record,
copied by `fit` from the host.json's sittings), and the estimate compares it with this one: on
another CPU (another model or family, or bf16 where the other computes fp32: a classifier step
1.4x, a fit step 1.3x) its wall is a guess, and it says so in one line. As the study runs, its
progress line's time left is the same simulation over the tasks not yet finished, each kind's
rate rescaled by what this machine measured of it (pipeline/study/time_left.py).

The verdict study ran the protocol before generator fits were units: one `generator` task
trained the judges and the encoder and fitted the generator (kind `generator`). A study now
trains those in its `generator` task (train runs on real/, at train's rate) and fits each
generator in a task of its own (`fit-f<f>`, `fit-cells`: kind `fit`). Both kinds keep a rate:
rates.py fits the one a host ran and derives the other.

This module reads the rates file (load_rates) and never imports the modules built on the
estimate (rates.py fits the file, time_left.py corrects the estimate as the study runs): they
import it, so the package has no import cycle.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.machine import describe, same_cpu, this_machine
from pipeline.chain import scoped_errors, split_sets
from pipeline.registry import resolve_stage_config
from pipeline.study.cells import CELL_FIT, GENERATOR, MAX_CELLS
from pipeline.study.config import StudyError, Task, cpu_count
from pipeline.study.schedule import (
    critical_path,
    held_cores,
    remaining_path,
    simulate,
)

RATES = Path(__file__).with_name("rates.json")  # the committed default (its "source" says whence)
RATES_ENV = "SEMIX_STUDY_RATES"  # another rates file: this machine's, or another `jobs`
REPORT = "report"  # the statistics, report and figures after the last task (one per sitting)

# Every kind, its unit and what it covers: the rows of the printed table, in this order.
KINDS: dict[str, tuple[str, str]] = {
    "prepare": ("task", "real/ (the chain's first step)"),
    "generator": ("fit step", "the judges, the encoder and fit 0 in one task (before fits)"),
    "fit": ("fit step", "one generator fit and its cell check, its encoder trained before it"),
    "chain": ("image-step", "a mixed set: generate (images x sampler steps) and annotate"),
    "train": ("seed-epoch", "a classifier on real/ only (a grid point or a stack of seeds)"),
    "train-mixed": ("seed-epoch", "a classifier that also reads a mixed set (the csm family)"),
    "finetune": ("run", "a fine-tuning (MaC-Cal, FeDLaS) of a trained run"),
    "evaluate": ("run", "a run's evaluation, with the shift and OOD sets when planned"),
    "robustness": ("task", "the shift and OOD sets"),
    REPORT: ("study", "statistics, report and figures after the last task"),
}
EXTENSION = "-ext-"  # a tuning grid's extension: runs only when its grid's choice is on an edge
CELL_TASKS = ("chain-cell-", "tune-cell-")  # a generator cell's set and runs: only kept cells run
FIT0, FIT_CELLS = "fit-f0", f"fit-{CELL_FIT}"  # plan.py's tasks of fit 0 and of the cell fit


class EstimateError(StudyError):
    """A rates file that cannot be used (missing, not JSON, a kind without a rate)."""


@dataclass(frozen=True)
class Work:
    """One step's expected work: `units` of `kind`, times `share`, the expected fraction of the
    plan's tasks like it that run at all (cells not kept, extensions not needed)."""

    kind: str
    units: float
    share: float = 1.0


# ---------------------------------------------------------------------------------------------
# 1. A task's work, from its resolved config


def _resolved(stage: str, preset: str, sets: Sequence[str]) -> Any:
    with scoped_errors(stage):
        return resolve_stage_config(stage, preset, list(sets))


def _chain_images(preset: str, chain_sets: Sequence[str], classes: int) -> float:
    """Images x sampler steps of the chain's generate step (its plan, stages/generate/plan.py,
    is a pure function of the config and the number of classes)."""
    from stages.generate.plan import make_plan
    from stages.presets import chain_steps

    extra = next((list(e) for stage, e in chain_steps(preset) if stage == "generate"), [])
    cfg = _resolved("generate", preset, [*extra, *split_sets(chain_sets, "generate")])
    plan = make_plan(cfg, classes)
    return plan.num_series * len(plan.alphas) * cfg.sample_steps


def _step_work(stage: str, sets: Sequence[str], preset: str, classes: int) -> Work:
    if stage == "chain":
        return Work("chain", _chain_images(preset, sets, classes))
    if stage in ("shift", "ood"):
        return Work("robustness", 1)
    if stage in ("prepare", "finetune", "evaluate"):
        return Work(stage, 1)
    if stage == "train":
        cfg = _resolved(stage, preset, sets)
        mixed = bool(cfg.mixed) or cfg.loss.name.startswith("csm")
        return Work("train-mixed" if mixed else "train", cfg.epochs * max(1, len(cfg.seeds)))
    if stage == "fit-generator":
        return Work("fit", _resolved(stage, preset, sets).train_steps)
    raise EstimateError(f"no rate model for a study step of stage {stage!r}")


def task_work(task: Task, preset: str, classes: int, cell_share: float, ext_share: float) -> Work:
    """A task's kind, units and share. A fit alone (fit-f<f>, fit-cells) is a `fit`; a fit
    after other steps (the generator task before fits: judges, encoder, fit) a `generator`, its
    judges and encoder riding on the fit's rate; any other task is its first step's kind (a
    train/finetune + evaluate task: its make step; an evaluate-only task: evaluate; the
    generator task that fits nothing: the judges' and encoder's seed-epochs at train's)."""
    works = [_step_work(stage, sets, preset, classes) for stage, sets in task.steps]
    fit = next((w for w in works if w.kind == "fit"), None)
    if fit is not None:
        work = fit if len(works) == 1 else Work("generator", fit.units)
    else:
        work = Work(works[0].kind, sum(w.units for w in works if w.kind == works[0].kind))
    share = cell_share if task.name.startswith(CELL_TASKS) else 1.0
    share *= ext_share if EXTENSION in task.name else 1.0
    return Work(work.kind, work.units, share)


def extra_evaluate(task: Task) -> int:
    """Evaluate steps after a task's make step (train/finetune + evaluate): each costs an
    evaluate run on top of the make step's rate."""
    kinds = [stage for stage, _ in task.steps]
    return kinds.count("evaluate") if kinds[0] != "evaluate" else 0


def plan_classes(root: Path, default: int) -> tuple[int, bool]:
    """The number of classes: real/'s manifest where it is made, else the rates file's (the
    reference study's), which the estimate then names as assumed (the second value)."""
    from shards.manifest import ShardError, read_manifest

    try:
        return len(read_manifest(root / "real" / "train").class_names), False
    except (ShardError, OSError, ValueError):
        return default, True


# ---------------------------------------------------------------------------------------------
# 2. Rates


def load_rates(path: Path | None = None) -> dict[str, Any]:
    """The rates file: `rates` (seconds per unit, per kind, inside a study), `alone` (those of
    the kinds measured alone, for a task that holds every core), `extension_share`, `classes`
    and its `source`. SEMIX_STUDY_RATES names another one; a missing or bad file is one line."""
    path = Path(path or os.environ.get(RATES_ENV) or RATES)
    try:
        rates = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EstimateError(
            f"cannot read the study's rates file {path} ({e}); point {RATES_ENV} at a rates "
            f"file (`python -m pipeline.study.rates fit HOST.json --preset P` writes one) or unset it"
        ) from e
    missing = sorted(set(KINDS) - set(rates.get("rates", {})))
    if missing:
        raise EstimateError(
            f"the rates file {path} has no rate for {', '.join(missing)}; refit it with "
            "`python -m pipeline.study.rates fit HOST.json --preset P`"
        )
    return rates


def generator_parts(tasks: Sequence[Task], preset: str, classes: int) -> tuple[float, float] | None:
    """(the judges' and encoder's seed-epochs, fit 0's steps): what the generator task of the
    protocol before fits held, read from a plan of either shape (its `generator` task's train
    steps; its fit step, or else fit-f0's). None: the plan has neither."""
    by_name = {t.name: t for t in tasks}
    generator = by_name.get(GENERATOR)
    steps = [
        *(generator.steps if generator else ()),
        *(by_name[FIT0].steps if FIT0 in by_name else ()),
    ]
    works = [_step_work(stage, sets, preset, classes) for stage, sets in steps]
    fits = [w.units for w in works if w.kind == "fit"]
    if not generator or not fits:
        return None
    return sum(w.units for w in works if w.kind == "train"), fits[0]


def expected_seconds(
    tasks: Sequence[Task],
    preset: str,
    rates: Mapping[str, Any],
    classes: int,
    cpus: int | None = None,
) -> tuple[dict[str, float], dict[str, Work]]:
    """Every task's expected seconds (0 for a task already done) and its work. With `cpus`
    (the core rule), a task that holds the whole machine runs alone: its kind's `alone` rate
    where the rates file has one (measured alone), else the study's rate."""
    cells = sum(1 for t in tasks if t.name.startswith(CELL_TASKS[0]))
    cell_share = min(1.0, MAX_CELLS / cells) if cells else 1.0
    ext_share = float(rates.get("extension_share", 1.0))
    r, alone = rates["rates"], rates.get("alone", {})
    seconds, works = {}, {}
    for t in tasks:
        w = task_work(t, preset, classes, cell_share, ext_share)
        works[t.name] = w
        wide = cpus is not None and held_cores(t, cpus) >= cpus
        rate = alone[w.kind] if wide and w.kind in alone else r[w.kind]
        own = w.units * rate + extra_evaluate(t) * r["evaluate"]
        seconds[t.name] = 0.0 if t.done else own * w.share
    return seconds, works


# ---------------------------------------------------------------------------------------------
# 3. The schedule: critical-path priorities and the simulated wall


@dataclass(frozen=True)
class Estimate:
    jobs: int
    wall: float  # the tasks' simulated wall plus the report's
    seconds: dict[str, float]
    works: dict[str, Work]
    critical: list[str]
    source: str
    classes_assumed: bool
    report: float = 0.0  # the statistics and report after the last task (in `wall`)
    cpus: int | None = None  # the core rule's machine; None: `jobs` only (order plan, critical)
    machine_note: str = ""  # the rates are another machine's (machine_line): "" when this one's

    def whole(self, name: str) -> float:
        """A pending task's expected seconds before its share (a share prices a task that may
        not run: a cell not kept, an extension not needed; one that runs, runs whole)."""
        share = self.works[name].share
        return self.seconds[name] / share if share > 0 else 0.0

    def by_kind(self) -> dict[str, tuple[int, float]]:
        """kind -> (pending tasks that cost anything, their task-seconds), in KINDS order."""
        rows: dict[str, tuple[int, float]] = {}
        for name, s in self.seconds.items():
            if s > 0:
                kind = self.works[name].kind
                n, total = rows.get(kind, (0, 0.0))
                rows[kind] = (n + 1, total + s)
        if self.report:
            rows[REPORT] = (1, self.report)
        return {k: rows[k] for k in KINDS if k in rows}

    def table(self) -> str:
        """The printed estimate: kind, tasks, task-minutes, minutes on the critical path, then
        the wall and where the rates come from."""
        on_path: dict[str, float] = {}
        for name in self.critical:
            kind = self.works[name].kind
            on_path[kind] = on_path.get(kind, 0.0) + self.seconds[name]
        lines = [f"{'kind':<12} {'tasks':>5} {'task-min':>9} {'critical min':>12}"]
        for kind, (n, s) in self.by_kind().items():
            lines.append(f"{kind:<12} {n:>5} {s / 60:>9.1f} {on_path.get(kind, 0) / 60:>12.1f}")
        lines.append(
            f"expected wall {hm(self.wall)} at {self.jobs} job(s)"
            + (f" on {self.cpus} core(s)" if self.cpus else "")
            + " "
            f"(critical path {hm(sum(self.seconds[n] for n in self.critical))}: "
            f"{' -> '.join(_short(self.critical))}); rates: {self.source}"
            + ("; classes assumed as the rates' study" if self.classes_assumed else "")
        )
        if self.machine_note:
            lines.append(self.machine_note)
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        """What host.json keeps, so the sitting's measured wall can be checked against it."""
        return {
            "wall_seconds": round(self.wall, 1),
            "jobs": self.jobs,
            "cpus": self.cpus,
            "task_minutes": {k: round(s / 60, 1) for k, (_, s) in self.by_kind().items()},
            "critical_path": self.critical,
            "rates": self.source,
            **({"machine_note": self.machine_note} if self.machine_note else {}),
        }


def hm(seconds: float) -> str:
    """`3 h 05 min` or `42 min`: every wall this module, time_left.py and rates.py print."""
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _short(names: Sequence[str], keep: int = 6) -> list[str]:
    return list(names) if len(names) <= keep else [*names[:3], "...", *names[-2:]]


def machine_line(theirs: Mapping[str, Any] | None, ours: Mapping[str, Any]) -> str:
    """The estimate's line when its rates are not this machine's: "" on the same CPU
    (core.machine.same_cpu); a rates file that names no machine (one fitted before rates files
    did) cannot be checked, and says that instead. The verdict's rates on a CPU without bf16
    priced a tuning run at 44 s that took 129-141 s there: several-fold is no exaggeration."""
    fix = "the progress line corrects it as tasks finish"
    if theirs is None:
        return (
            f"rates from a machine their file does not name; this machine is {describe(ours)}: "
            f"on another CPU this wall is a guess; {fix}"
        )
    if same_cpu(theirs, ours):
        return ""
    return (
        f"rates from {describe(theirs)}; this machine is {describe(ours)}: a different CPU, so "
        f"this wall is a guess (it can be several-fold off); {fix}"
    )


ORDERS = ("cores", "critical", "plan")  # estimate()'s schedulers, execute.py's first


def estimate(
    tasks: Sequence[Task],
    preset: str,
    jobs: int,
    root: Path,
    rates: Mapping[str, Any] | None = None,
    order: str = "cores",
    cpus: int | None = None,
    machine: Mapping[str, Any] | None = None,
) -> Estimate:
    """The plan's expected wall at `jobs` under one of three schedulers: "cores" (execute.py's:
    critical path first and the core rule on `cpus`, this machine's by default; a task that
    holds every core runs alone, at its kind's alone rate), "critical" (critical path first,
    `jobs` only) or "plan" (plan order, `jobs` only: how the verdict study ran). The report's
    seconds are added once, when any task is pending. `machine`: the machine the plan runs on
    (this one's record by default, core.machine), checked against the rates' (machine_line)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: one of {', '.join(ORDERS)}")
    rates = rates or load_rates()
    classes, assumed = plan_classes(root, int(rates.get("classes", 10)))
    cpus = (cpus or cpu_count()) if order == "cores" else None
    seconds, works = expected_seconds(tasks, preset, rates, classes, cpus)
    path = remaining_path(tasks, seconds)
    schedule = simulate(tasks, seconds, jobs, path if order != "plan" else None, cpus)
    pending = any(not t.done for t in tasks)
    report = rates["rates"][REPORT] if pending else 0.0
    return Estimate(
        jobs,
        schedule.wall + report,
        seconds,
        works,
        critical_path(tasks, path),
        rates.get("source", "?"),
        classes_assumed=assumed,
        report=report,
        cpus=cpus,
        machine_note=machine_line(rates.get("machine"), machine or this_machine()),
    )


def measured_line(est_wall: float, measured: float) -> str:
    """The sitting's check of its estimate: measured vs estimated wall, in %."""
    delta = 100.0 * (measured - est_wall) / est_wall if est_wall else math.nan
    return (
        f"study: this sitting's wall {hm(measured)} against the estimate's {hm(est_wall)} "
        f"({delta:+.0f} %)"
    )
