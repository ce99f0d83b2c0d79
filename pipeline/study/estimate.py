"""How long a study's plan takes on this machine, before its first task: every task's expected
seconds from measured rates (one model per task kind), then the scheduler of execute.py
simulated over the plan (`jobs` at a time, the same dependencies, the same order, the same core
rule: pipeline.study.schedule), giving the expected wall and the critical path.

The rates are seconds per unit of work as a task of that kind took them *inside a study*, with
`jobs - 1` other tasks beside it on the same cores: what the scheduler sees. The committed
default (rates.json) is fitted from the verdict study's own host.json (docs/results/fashion-
verdict/, 2 jobs on 2 cores; `python -m pipeline.study.estimate fit` remakes it and prints the
cross-check). A task's units come from its resolved config, so a plan with more seeds, epochs,
fit steps or images costs more without a new fit; another machine, or another `jobs`, needs
its own rates file (`--set` nothing: pass the file as SEMIX_STUDY_RATES). A task that holds
every core runs alone under the core rule, so its kind's `alone` rate (measured alone, not
fitted: the file's `alone_source` says where) replaces the study's for it.

The rates file names the machine its rates were measured on (`machine`, core.machine's record,
copied by `fit` from the host.json's sittings), and the estimate compares it with this one: on
another CPU (another model or family, or bf16 where the other computes fp32: a classifier step
1.4x, a fit step 1.3x) its wall is a guess, and it says so in one line. As the study runs, its
progress line's time left is the same simulation over the tasks not yet finished, each kind's
rate rescaled by what this machine measured of it (TimeLeft).

The verdict study ran the protocol before generator fits were units: one `generator` task
trained the judges and the encoder and fitted the generator. A study now trains those in its
`generator` task (train runs on real/, at train's rate) and fits each generator in a task of
its own (`fit-f<f>`, `fit-cells`), so a fit alone has a rate of its own, `fit`: measured where a
host ran such tasks, else derived from the old task's (derive_rates), and the plan is rebuilt
in the old task's shape to fit rates on such a host (before_fits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
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
            f"file (`python -m pipeline.study.estimate fit HOST.json --preset P` writes one) or unset it"
        ) from e
    missing = sorted(set(KINDS) - set(rates.get("rates", {})))
    if missing:
        raise EstimateError(
            f"the rates file {path} has no rate for {', '.join(missing)}; refit it with "
            "`python -m pipeline.study.estimate fit HOST.json --preset P`"
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


def derive_rates(rates: dict[str, float], seed_epochs: float, steps: float) -> dict[str, str]:
    """The fit rates one shape of plan cannot measure, from the other's (in place): the generator
    task before fits = its judges' and encoder's `seed_epochs` at train's rate + a fit of
    `steps` at fit's rate, so per fit step
        fit = generator - train x seed_epochs / steps     (a host before fits: the verdict's)
        generator = fit + train x seed_epochs / steps     (a host whose fits ran alone).
    The fit then carries its cell check and its share of the slowdown beside other tasks as
    the generator task did. Returns how each derived rate was made (the rates file's record)."""
    share = rates.get("train", 0.0) * seed_epochs / steps
    formula = f"train x {seed_epochs:g} seed-epochs / {steps:g} fit steps"
    if rates.get("generator") and not rates.get("fit"):
        rates["fit"] = max(0.0, rates["generator"] - share)
        return {"fit": f"generator - {formula}"}
    if rates.get("fit") and not rates.get("generator"):
        rates["generator"] = rates["fit"] + share
        return {"generator": f"fit + {formula}"}
    return {}


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
            f"expected wall {_hm(self.wall)} at {self.jobs} job(s)"
            + (f" on {self.cpus} core(s)" if self.cpus else "")
            + " "
            f"(critical path {_hm(sum(self.seconds[n] for n in self.critical))}: "
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


def _hm(seconds: float) -> str:
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
        f"study: this sitting's wall {_hm(measured)} against the estimate's {_hm(est_wall)} "
        f"({delta:+.0f} %)"
    )


# ---------------------------------------------------------------------------------------------
# 4. The time left as the study runs: the estimate, each kind's rate as measured here

LEFT_EVERY_S = 60.0  # TimeLeft simulates at most this often (simulate: ~tasks² steps, ~0.1 s)


def correction(finished: Mapping[str, float], est: Estimate) -> dict[str, float]:
    """kind -> measured / estimated seconds of this invocation's `finished` tasks of that kind
    that ran (a task at 0 s ran nothing: a cell not kept, an extension not needed, as fit_rates
    counts them), each at its expected seconds before its share (Estimate.whole). A kind with
    nothing finished has no entry: it keeps its rate."""
    sums: dict[str, list[float]] = {}
    for name, measured in finished.items():
        if name not in est.works or measured <= 0 or est.whole(name) <= 0:
            continue
        total = sums.setdefault(est.works[name].kind, [0.0, 0.0])
        total[0] += measured
        total[1] += est.whole(name)
    return {kind: m / e for kind, (m, e) in sums.items()}


def _factors(factor: Mapping[str, float]) -> str:
    rows = [f"{kind} x{factor[kind]:.1f}" for kind in KINDS if kind in factor]
    return f"rates as measured here: {', '.join(rows)}" if rows else "the estimate's rates"


class TimeLeft:
    """The study's time left for its progress line (execute.py): the estimate's own simulation
    (schedule.simulate: the same priorities, `jobs` and core rule) over the tasks not finished,
    each kind's expected seconds times what this invocation measured of that kind against its
    estimate (`correction`), a running task's less the seconds it has run; not the line's runs
    per second, which prices a 20-s evaluation like a 20-min chain. On another CPU than the
    rates' (the verdict's rates on a CPU without bf16: 3x the tuning runs' seconds) the first
    finished tasks of a kind correct the rest of it. Simulates at most once every `every`
    seconds (the line asks at each task's end, ~250-500 times a study) and counts down from
    the last answer in between."""

    def __init__(
        self,
        tasks: Sequence[Task],
        est: Estimate,
        priority: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        every: float = LEFT_EVERY_S,
    ) -> None:
        self.tasks, self.est = list(tasks), est
        self.priority = priority if priority is not None else remaining_path(tasks, est.seconds)
        self.clock, self.every = clock, every
        self._last: tuple[float, float, str] | None = None  # (when, seconds left, its rates)

    def seconds_left(
        self,
        finished: Mapping[str, float],
        running: Mapping[str, float],
        dropped: Collection[str] = (),
    ) -> tuple[float, dict[str, float]]:
        """(the seconds left, the correction per kind): `finished` this invocation's task
        seconds, `running` the running tasks' seconds so far, `dropped` the tasks that failed
        (they and their dependants cost nothing more, as execute.py skips them). The report's
        seconds are added, uncorrected, while anything is left."""
        factor = correction(finished, self.est)
        failed = set(dropped)
        for t in self.tasks:  # plan order, a task after what it needs: one pass skips a chain
            if t.after & failed:
                failed.add(t.name)
        gone = set(finished) | failed
        seconds: dict[str, float] = {}
        under_way: dict[str, float] = {}
        for t in self.tasks:
            if t.done or t.name in gone:
                continue
            rescale = factor.get(self.est.works[t.name].kind, 1.0)
            if t.name in running:
                under_way[t.name] = max(0.0, self.est.whole(t.name) * rescale - running[t.name])
            else:
                seconds[t.name] = self.est.seconds[t.name] * rescale
        tasks = [dataclasses.replace(t, done=True) if t.name in gone else t for t in self.tasks]
        est = self.est
        wall = simulate(tasks, seconds, est.jobs, self.priority, est.cpus, under_way).wall
        return wall + (est.report if seconds or under_way else 0.0), factor

    def line(
        self,
        finished: Mapping[str, float],
        running: Mapping[str, float],
        dropped: Collection[str] = (),
    ) -> str:
        """`~3 h 10 min left (rates as measured here: train x2.9)`: seconds_left, simulated at
        most once every `every` seconds, counted down in between."""
        now = self.clock()
        if self._last is None or now - self._last[0] >= self.every:
            left, factor = self.seconds_left(finished, running, dropped)
            self._last = (now, left, _factors(factor))
        when, left, rates = self._last
        return f"~{_hm(max(0.0, left - (now - when)))} left ({rates})"


# ---------------------------------------------------------------------------------------------
# 5. Fitting rates from a study's host.json (the committed default is this on the verdict's)


def sittings(host: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every sitting of a host.json, first to last."""
    last = {k: v for k, v in host.items() if k != "earlier_invocations"}
    return [*host.get("earlier_invocations", []), last]


def host_machine(
    host: Mapping[str, Any], use: Callable[[int], bool] = lambda i: True
) -> tuple[dict[str, Any] | None, str]:
    """The machine whose seconds the sittings `use` selects (by index) measured, for the rates
    file (`fit` copies it), and a note where that is not one machine: sittings on different
    CPUs (the rates mix them; the last one's is named), or none that names one (a host.json
    from before sittings recorded their machine: the verdict's; name it by hand, as
    rates.json's `machine_note` says). Only sittings that ran tasks count."""
    ran = [s for i, s in enumerate(sittings(host)) if use(i)]
    ran = [s for s in ran if s.get("task_seconds_this_invocation")]
    named = [s["machine"] for s in ran if s.get("machine")]
    if not named:
        return None, "the host.json names no machine (its study ran before sittings did)"
    if len(named) < len(ran) or any(not same_cpu(m, named[-1]) for m in named):
        machines = "; ".join(dict.fromkeys(describe(m) for m in named))
        return named[-1], (
            f"{len(ran)} sittings, {len(named)} naming their machine ({machines}): the rates "
            "mix what they measured; `machine` is the last one's"
        )
    return named[-1], ""


def ran_before_fits(host: Mapping[str, Any]) -> bool:
    """Whether a host.json's study ran the protocol before generator fits (a `generator` task
    that fitted, no fit-f0 task): the verdict study's."""
    names = {n for s in sittings(host) for n in s.get("task_seconds_this_invocation", {})}
    return GENERATOR in names and FIT0 not in names


def before_fits(tasks: Sequence[Task]) -> list[Task]:
    """The plan as the protocol before generator fits ran it: fit 0's fit-generator step at the
    end of the `generator` task (judges, encoder, fit: one task), no cell fit (the cells drawn
    from fit 0's generator), every task that waited on either waiting on `generator`. On the
    plan of study.fits=1 study.mixed_sets=3 this is the verdict study's plan, task for task, so
    its host.json's seconds fit rates (and the plan is estimated as it ran). A plan without
    fit-f0 (no generator task) as it is."""
    by_name = {t.name: t for t in tasks}
    if GENERATOR not in by_name or FIT0 not in by_name:
        return list(tasks)
    fit0, merged = by_name[FIT0], {FIT0, FIT_CELLS}
    out = []
    for t in tasks:
        if t.name in merged:
            continue
        after = {GENERATOR if a in merged else a for a in t.after} - {t.name}
        if t.name == GENERATOR:
            t = dataclasses.replace(
                t,
                steps=[*t.steps, *fit0.steps],
                done=t.done and fit0.done,
                cores=max(t.cores, fit0.cores),  # the fit's cores: the task holds them
            )
        out.append(dataclasses.replace(t, after=after))
    return out


def fit_rates(
    measured: Mapping[str, float],
    works: Mapping[str, Work],
    extra_evals: Mapping[str, int],
    evaluate_rate: float | None = None,
) -> dict[str, float]:
    """Seconds per unit of each kind: the total measured seconds over the total units of the
    tasks that ran (a task at 0 s ran nothing: a cell not kept, an extension not needed). A
    train/finetune + evaluate task pays its evaluation at the evaluate-only tasks' rate first."""
    ran = {n: s for n, s in measured.items() if s > 0 and n in works}
    evals = [s for n, s in ran.items() if works[n].kind == "evaluate"]
    ev = evaluate_rate if evaluate_rate is not None else (sum(evals) / len(evals) if evals else 0)
    total: dict[str, list[float]] = {}
    for n, s in ran.items():
        kind = works[n].kind
        t = total.setdefault(kind, [0.0, 0.0])
        t[0] += max(0.0, s - extra_evals.get(n, 0) * ev)
        t[1] += works[n].units
    rates = {k: t[0] / t[1] for k, t in total.items() if t[1] > 0}
    if "evaluate" in rates or evals:
        rates["evaluate"] = ev
    return rates


def _fit_main(argv: Sequence[str]) -> int:
    """`python -m pipeline.study.estimate fit HOST.json --preset P [--set ...] [--out F]`:
    fit rates from a study's host.json on the plan its config makes (the task names must
    match: the verdict's is `--set study.fits=1 study.mixed_sets=3`, rebuilt before_fits), print the cross-check (rates from the first sitting predicting the others'
    task seconds, and the simulated wall against the measured one), write the rates file."""
    import argparse

    from pipeline.study.plan import setup

    p = argparse.ArgumentParser(prog="python -m pipeline.study.estimate fit")
    p.add_argument("host", type=Path)
    p.add_argument("--preset", required=True)  # the study's (only presets name a preset)
    p.add_argument("--set", dest="sets", nargs="*", default=[])
    p.add_argument("--report-seconds", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    host = json.loads(args.host.read_text(encoding="utf-8"))
    cfg, root, tasks = setup(args.preset, [*args.sets, "out=/nonexistent-study-root"], data=False)
    if ran_before_fits(host):  # the verdict's: its generator task fitted fit 0, no cell fit
        tasks = before_fits(tasks)
    print(cross_check(host, tasks, args.preset, cfg.jobs, root, args.report_seconds))
    rates = rates_from_host(host, tasks, args.preset, args.report_seconds)
    # the alone rates are measured alone, not in a study: kept from the committed file
    committed = load_rates(RATES)
    rates |= {k: committed[k] for k in ("alone", "alone_source") if k in committed}
    source = f"{args.host} ({cfg.jobs} jobs, {sittings(host)[-1].get('cpu_count')} cores)"
    if "machine" not in rates and committed.get("source") == source:
        # the committed file refitted from its own host.json (the verdict's names no machine):
        # the machine named by hand stays
        rates |= {k: committed[k] for k in ("machine", "machine_note") if k in committed}
    rates["source"] = source
    text = json.dumps(rates, indent=2) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _units(tasks: Sequence[Task], preset: str, classes: int) -> tuple[dict, dict]:
    works = {t.name: task_work(t, preset, classes, 1.0, 1.0) for t in tasks}
    return works, {t.name: extra_evaluate(t) for t in tasks}


def rates_from_host(
    host: Mapping[str, Any],
    tasks: Sequence[Task],
    preset: str,
    report_seconds: float | None,
    classes: int = 10,
    use: Callable[[int], bool] = lambda i: True,
) -> dict[str, Any]:
    """A rates file's content from the sittings `use` selects (by index): each task's seconds
    from the last selected sitting that ran it; the extension share from the plan (extension
    tasks that ran / planned); the report's seconds as given (the last sitting's wall past its
    last task: the caller reads it from that sitting's log); the machine they ran on
    (host_machine: what the estimate checks this machine against)."""
    measured: dict[str, float] = {}
    for i, s in enumerate(sittings(host)):
        if use(i):
            measured.update(s.get("task_seconds_this_invocation", {}))
    works, evals = _units(tasks, preset, classes)
    rates: dict[str, Any] = {"rates": fit_rates(measured, works, evals)}
    parts = generator_parts(tasks, preset, classes)
    derived = derive_rates(rates["rates"], *parts) if parts else {}
    ext = [n for n in works if EXTENSION in n and n in measured]
    rates["extension_share"] = (
        round(sum(measured[n] > 0 for n in ext) / len(ext), 3) if ext else 1.0
    )
    rates["rates"][REPORT] = report_seconds or 0.0
    rates["rates"] = {k: rates["rates"].get(k, 0.0) for k in KINDS}
    rates["classes"] = classes
    rates["units"] = {k: u for k, (u, _) in KINDS.items()}
    if derived:
        rates["derived"] = derived
    machine, note = host_machine(host, use)
    if machine:
        rates["machine"] = machine
    if note:
        rates["machine_note"] = note
    return rates


def cross_check(
    host: Mapping[str, Any],
    tasks: Sequence[Task],
    preset: str,
    jobs: int,
    root: Path,
    report_seconds: float | None,
) -> str:
    """How well the model predicts what it was not fitted on: rates from sitting 1 alone
    against the other sittings' task seconds, kind by kind; then the whole plan's simulated
    wall (plan order, as the study ran) from those rates and from every sitting's, against the
    measured wall summed over the sittings."""
    works, evals = _units(tasks, preset, 10)
    first = rates_from_host(host, tasks, preset, report_seconds, use=lambda i: i == 0)
    every = rates_from_host(host, tasks, preset, report_seconds)
    later: dict[str, float] = {}
    for s in sittings(host)[1:]:
        later.update(s.get("task_seconds_this_invocation", {}))
    rows, pred_total, meas_total = [], 0.0, 0.0
    for kind in KINDS:
        names = [n for n, s in later.items() if s > 0 and n in works and works[n].kind == kind]
        if not names:
            continue
        pred = sum(
            works[n].units * first["rates"][kind] + evals[n] * first["rates"]["evaluate"]
            for n in names
        )
        meas = sum(later[n] for n in names)
        pred_total, meas_total = pred_total + pred, meas_total + meas
        rows.append(f"  {kind:<12} {len(names):>4} tasks  predicted {pred / 60:7.1f} min  "
                    f"measured {meas / 60:7.1f} min  ({100 * (pred - meas) / meas:+.0f} %)")  # fmt: skip
    wall = sum(s.get("wall_seconds_this_invocation", 0.0) for s in sittings(host))
    out = ["sittings 2.. predicted from sitting 1's rates (task seconds):", *rows]
    out.append(f"  total {pred_total / 60:.1f} min predicted, {meas_total / 60:.1f} measured "
               f"({100 * (pred_total - meas_total) / meas_total:+.0f} %)")  # fmt: skip
    for label, rates in (("sitting 1's rates", first), ("every sitting's rates", every)):
        for order in ("plan", "critical"):
            e = estimate(tasks, preset, jobs, root, rates, order)
            out.append(f"whole plan, {label}, {order} order: {_hm(e.wall)} ({e.wall:.0f} s) vs "
                       f"measured {_hm(wall)} ({wall:.0f} s): {100 * (e.wall - wall) / wall:+.1f} %")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] != ["fit"]:
        sys.exit("usage: python -m pipeline.study.estimate fit HOST.json --preset P [--out F]")
    sys.exit(_fit_main(sys.argv[2:]))
