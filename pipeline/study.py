"""`make study`: does semix calibrate? Every method x seed on one dataset, side by side.

    make study CLASSES=fashion-mnist
    python -m pipeline study --preset fashion-mnist --set study.seeds=0,1 study.other_seeds=1

1. The generation chain (`make generate`), when a method needs mixed/ (skipped when complete).
2. For every method and seed: train (or fine-tune its Stage-I run), then evaluate. Runs are
   subprocesses, `jobs` at a time (each stage pins its own CPU threads), so one slow run does
   not hold the others; a method that needs mixed/ waits for the chain, the others start at once.
3. study/study.json (one record per run + summaries) and study/report.md: mean ± std over seeds
   of every metric before and after temperature scaling, and a bootstrap 95 % interval of each
   method's ECE difference to `ce`; figures: reliability diagrams of ce vs csm (seeds pooled)
   and ECE per method with error bars. The seconds this invocation took go to study/host.json,
   so study.json is the same bytes on any machine.

Resumable: a run whose evaluation exists is not touched again, and train/finetune resume from
their own checkpoints, so a killed study reruns only what is missing. Every run writes its log
to study/logs/<run>.log.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.config import describe_fields, parse_sets
from core.io import atomic_write_json
from core.logs import log
from core.runtime import derive_seed
from pipeline import study_shift
from pipeline.chain import chain_fields, check_chain, scoped_errors, split_sets
from pipeline.registry import resolve_stage_config
from pipeline.study_config import (
    METHODS,
    METRICS,
    POSTHOC,
    StudyConfig,
    Task,
    check_budget,
    comparison_pairs,
    run_name,
)
from pipeline.study_exec import _execute, execute  # noqa: F401 (the study's runner)
from pipeline.study_intervals import mixed_sets_of
from pipeline.study_kway import (
    chain_task,
    mixed_images,
    prepare_set,
    set_variant,
    variant_root,
)
from pipeline.study_records import collect, seed_predictions
from pipeline.study_report import figures, write_report
from pipeline.study_stats import (
    MARGINS,
    compare,
    summarize,
)
from pipeline.study_tune import (
    chosen_groups,
    chosen_sets,
    plan_groups,
    tuning_report,
    tuning_tasks,
)
from shards import evals
from shards.budget import labelled_split_images
from shards.manifest import ShardError, is_complete, read_manifest
from shards.writer import check_config
from stages.presets import chain_steps, reader

RUNS = ("train", "finetune", "evaluate")  # the stages a study runs after the chain


def _evaluated(folder: Path, criterion: str) -> bool:
    """A complete evaluation (eval/<stage>/<run>/, shards/evals.py) with this TS criterion, made
    from the run as it is now (same run digest). Otherwise the task runs: train/finetune skip a
    finished run and evaluate redoes only what is stale."""
    from stages.evaluate import run_digest

    key = f"{folder.parent.name}/{folder.name}"  # <stage>/<run>, as evaluate names it
    run = folder.parent.parent.parent / key
    try:
        metrics = evals.read_metrics(folder)  # checked against its manifest; None: not there
        if not metrics or not is_complete(run):
            return False
        made_from = read_manifest(folder).upstream.get(key)
    except ShardError:  # damaged: the task's evaluate step redoes it
        return False
    return made_from == run_digest(run) and metrics["evaluation"].get("ts_criterion") == criterion


DATA = "prepare"  # the task that makes real/: every other task waits for it, directly or not
SPLITS = ("train", "val", "test")


def data_task(preset: str, chain_sets: Sequence[str], root: Path) -> Task:
    """real/ as the chain's first step makes it (the same config, so the chain then finds it
    complete), its own task so that the runs that need only real/ start as soon as it exists."""
    extra = next((list(e) for stage, e in chain_steps(preset) if stage == DATA), [])
    done = all(is_complete(root / "real" / split) for split in SPLITS)
    return Task(DATA, [(DATA, [*extra, *split_sets(chain_sets, DATA)])], done=done)


def plan(cfg: StudyConfig, preset: str, sets: Sequence[str], root: Path) -> list[Task]:
    """The chain (if needed), the tuning grids the methods need (pipeline/study_tune.py) and
    one task per (method, seed): train/finetune + evaluate."""
    needs_chain = any(METHODS[m].needs_mixed for m in cfg.methods)
    chain_sets = [s for s in sets if not s.startswith("study.")]
    tasks: list[Task] = [data_task(preset, chain_sets, root)]
    if needs_chain:
        done = is_complete(root / "mixed")
        tasks.append(Task("chain", [("chain", chain_sets)], {DATA}, done))

    gen_seed = generate_seed(preset, chain_sets) if needs_chain and cfg.mixed_sets > 1 else 0

    def set_chain(variant: str, index: int) -> Task:
        """The chain of a family's mixed set `index` into its own root (set 0 of csm: "chain")."""
        name = set_variant(variant, index)
        v_root = variant_root(root, name)
        v_sets = [*(s for s in chain_sets if not s.startswith("name=")), f"name={v_root.name}"]
        done = is_complete(v_root / "mixed")
        prepare = functools.partial(prepare_set, root, variant, index, gen_seed)
        return Task(chain_task(name), [("chain", v_sets)], {"chain"}, done, prepare)

    train_sets, ft_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    tuned = tuning_tasks(cfg, root, sets) if cfg.tune else {}
    # evaluate pinned to 1 CPU thread unless the command line says otherwise: `jobs` runs fill
    # the cores, and torch's default (every core in each) oversubscribes them (4-8x slower
    # here); pinned, the numbers do not depend on the machine's core count either
    eval_sets = ["cpu_threads=1", *split_sets(sets, "evaluate"), f"ts_criterion={cfg.ts_criterion}"]
    robust: set[str] = set()  # the tasks every evaluation waits for: the shift and OOD sets
    if cfg.robustness:
        # the shift and OOD sets read real/ only: made beside the chain
        extra, reads = study_shift.robustness_tasks(root, preset, {DATA}, chain_sets)
        tasks += extra
        eval_sets += reads
        robust = {t.name for t in extra}
    # method by method (all its seeds), in the order given; a variant's chain and a tuning
    # grid join the list just before the first method that needs them. Tasks start in list
    # order once what they need is done, so the methods given first are done first.
    for method in cfg.methods:
        variant = METHODS[method].variant
        if METHODS[method].needs_mixed:  # every mixed set its seeds train on
            for index in sorted({cfg.mixed_set(method, seed) for seed in cfg.seeds_of(method)}):
                name = chain_task(set_variant(variant, index))
                if not any(t.name == name for t in tasks):
                    tasks.append(set_chain(variant, index))
        planned = {t.name for t in tasks}
        for g in plan_groups(method) if cfg.tune else ():
            tasks += [t for t in tuned[g] if t.name not in planned]
        m = METHODS[method]
        prepare, tuning = None, set()
        if cfg.tune and chosen_groups(method):  # its hyper-parameters as chosen on val
            tuning = {t.name for g in plan_groups(method) for t in tuned[g]}
            prepare = functools.partial(chosen_sets, root, tuned, chosen_groups(method))
        stacks = {}
        if cfg.stack and m.stage == "train":  # one stack per mixed set: they differ by seed only
            for seed in cfg.seeds_of(method):
                stacks.setdefault(cfg.mixed_set(method, seed) or 0, []).append(seed)
            for index, seeds in stacks.items():
                mixed = set_variant(m.variant, index)
                after = ({chain_task(mixed)} if m.needs_mixed else set()) | tuning
                tasks.append(stack_task(root, method, mixed, seeds, train_sets, after, prepare))
        for seed in cfg.seeds_of(method):
            name = run_name(method, seed)
            mixed = set_variant(m.variant, cfg.mixed_set(method, seed) or 0)
            stage_dir = "train" if m.stage == "train" else "finetune"
            evaluate = ("evaluate", [*eval_sets, f"run={name}", f"stage_dir={stage_dir}"])
            after = ({chain_task(mixed)} if m.needs_mixed else set()) | robust | tuning
            if m.base:
                after.add(run_name(m.base, seed))
            folder = evals.eval_dir(root, stage_dir, name)
            done = _evaluated(folder, cfg.ts_criterion) and (
                not cfg.robustness or study_shift.read_them(folder, preset)
            )
            if stacks:  # trained by its stack: this task evaluates
                after.add(stack_name(method, mixed))
                tasks.append(Task(name, [evaluate], after, done))
                continue
            if m.stage == "train":
                own = (f"run={name}", f"seed={seed}")
                make = train_step(root, method, mixed, train_sets, *own)
            else:
                base = run_name(m.base, seed)
                make = ("finetune", [*ft_sets, *m.sets, f"run={base}", f"seed={seed}"])
            tasks.append(Task(name, [make, evaluate], after, done, prepare, extra_step=0))
    for t in tasks[1:]:  # every task reads the data: each waits for it, directly or not
        if not t.after:
            t.after.add(DATA)
    return tasks


def stack_name(method: str, mixed: str) -> str:
    """The task that trains a method's seeds on one mixed set together."""
    return f"train-{method}" + (f"-{mixed}" if mixed else "")


def stack_task(
    root: Path,
    method: str,
    mixed: str,
    seeds: Sequence[int],
    train_sets: Sequence[str],
    after: set[str],
    prepare: Callable[[], list[str] | None] | None,
) -> Task:
    """`train run=<method> seeds=a,b,...`: runs <method>-s<seed>, each its own folder and
    config.json as when trained alone (stages/train.py run_stack), in one process. Done when
    every run is complete; a rerun trains only the seeds that are not."""
    own = (f"run={method}", f"seeds={','.join(map(str, seeds))}")
    step = train_step(root, method, mixed, train_sets, *own)
    done = all(is_complete(root / "train" / run_name(method, s)) for s in seeds)
    return Task(stack_name(method, mixed), [step], after, done, prepare)


def train_step(
    root: Path, method: str, mixed: str, train_sets: Sequence[str], *own: str
) -> tuple[str, list[str]]:
    """train's step of `method` with the run's `own` values, on mixed set `mixed` (csm's set 0
    is <root>/mixed, the train stage's default)."""
    sets = [*train_sets, *METHODS[method].sets, *own]
    if mixed:
        sets.append(f"mixed={variant_root(root, mixed) / 'mixed'}")
    return "train", sets


def generate_seed(preset: str, chain_sets: Sequence[str]) -> int:
    """The seed the chain's generate step draws csm's mixed set with (the others': + index)."""
    extra = next((list(e) for stage, e in chain_steps(preset) if stage == "generate"), [])
    with scoped_errors("generate"):
        return resolve_stage_config(
            "generate", preset, [*extra, *split_sets(chain_sets, "generate")]
        ).seed


# ---------------------------------------------------------------- report


def setup(
    preset: str, sets: Sequence[str], data: bool = True
) -> tuple[StudyConfig, Path, list[Task]]:
    """Study fields (`study.key=value`), the run root, and the plan. Every task's config is
    checked up front (check_tasks; `data`: the data source too, which --print-config, a
    machine without the data, leaves out), so a misspelt field fails now, not an hour in.
    Reads only."""
    study_sets = [s.removeprefix("study.") for s in sets if s.startswith("study.")]
    cfg = StudyConfig(**parse_sets(StudyConfig, study_sets, lambda key: f"study.{key}"))
    root = resolve_stage_config("train", preset, split_sets(sets, "train")).root
    tasks = plan(cfg, preset, sets, root)
    check_tasks(preset, tasks, data)
    if any(task.name == "chain" and task.done for task in tasks):
        check_generator(preset, [s for s in sets if not s.startswith("study.")], root)
    return cfg, root, tasks


def check_tasks(preset: str, tasks: Sequence[Task], data: bool = True) -> None:
    """Everything the plan can check before a task starts, each failure one line naming the
    key: every run's config and every pending chain's steps (its checks, pipeline/chain.py),
    then, while real/ is still to be made, that the preset's source finds its data (a data
    folder, an archive): what a pending task would otherwise find out minutes in."""
    for task in tasks:
        for stage, stage_sets in task.steps:
            if stage == "chain":
                if not task.done:
                    check_chain(preset, stage_sets)
                continue
            with scoped_errors(stage):
                cfg = resolve_stage_config(stage, preset, stage_sets)
            if data and task.name == DATA and not task.done:
                with scoped_errors(DATA):
                    reader(cfg.source)(cfg)  # locates and lists the data; writes nothing


def check_generator(preset: str, chain_sets: Sequence[str], root: Path) -> None:
    """A done chain is reused as it is, so its generator must be the one this config asks for:
    a preset that changed since (fashion-mnist's prediction_type did) would otherwise be reported
    on with the old generator's data. Refused in one line naming the fields and both fixes."""
    folder = root / "generator"
    if not (folder / "config.json").is_file():
        return  # this chain has no in-house generator (sd, dit, edm backends)
    with scoped_errors("fit-generator"):
        cfg = resolve_stage_config("fit-generator", preset, split_sets(chain_sets, "fit-generator"))
    check_config(
        folder,
        cfg.recorded(),
        fix="the study reuses a done chain as it is: add --set fit-generator.<field>=<the value "
        "it has; unset = the default before the field existed, prediction_type=epsilon> to "
        "report on it, or set out= to a new root to build the chain anew",
    )


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
    t0 = time.perf_counter()
    seconds = execute(tasks, preset, cfg.jobs, out / "logs")
    # 3. Records, statistics, report and figures.
    records = collect(cfg, root)
    budget = check_budget(records)
    summary = summarize(records, METRICS)
    by_seed = seed_predictions(root, records)
    # paired by seed and test image (mixed sets the top-level units where records carry them),
    # the intervals of pipeline/study_intervals.py, verdicts against the margins fixed in
    # pipeline/study_stats.py (MARGINS) before any run
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
        wanted = study_shift.comparisons(cfg.methods)
        robust = {
            "shift": study_shift.shift_paired(
                root, records, wanted, cfg.bootstrap, study_shift.rng
            ),
            "ood": study_shift.ood_paired(
                root, records, cfg.methods, cfg.bootstrap, study_shift.rng
            ),
        }
    tuning = tuning_report(cfg, root, sets) if cfg.tune else {}
    variants = sorted(
        set_variant(METHODS[m].variant, cfg.mixed_set(m, seed))
        for m in cfg.methods
        if METHODS[m].needs_mixed
        for seed in cfg.seeds_of(m)
    )
    variants = [v for v in dict.fromkeys(variants) if v]
    images = mixed_images(root, variants) if variants else None
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out / "study.json",
        {
            "dataset": root.name,
            "labelled_images": labelled_split_images(root, budget),
            "labelled_train_images": budget,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
            "records": records,
            "summary": summary,
            "paired": paired,
            "margins": MARGINS,
            "tuning": tuning,
            "mixed_images": images,
            "shift_paired": robust["shift"],
            "ood_paired": robust["ood"],
        },
    )
    # what this machine took, apart: study.json is the same bytes wherever the study ran
    atomic_write_json(
        out / "host.json",
        {
            "task_seconds_this_invocation": seconds,
            "wall_seconds_this_invocation": round(time.perf_counter() - t0, 1),
        },
    )
    figures(cfg, root, out, {m: list(p.values()) for m, p in by_seed["before_ts"].items()}, summary)
    report = write_report(
        cfg, root, out, records, summary, paired, tuning, images,
        robust if cfg.robustness else None,
    )  # fmt: skip
    if cfg.robustness:
        study_shift.figure(records, out / "shift.png", f"{root.name}: under corruption, after TS")
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
    return {
        "study": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
        "root": str(root),
        "tasks": [
            {
                "name": t.name,
                "done": t.done,
                "after": sorted(t.after),
                "steps": [{"stage": stage, "sets": list(s)} for stage, s in t.steps],
            }
            for t in tasks
        ],
    }


def main(preset: str, sets: Sequence[str]) -> None:
    """`python -m pipeline study`: run it, then print where the report is and its goal."""
    report = run_study(preset, sets)
    print(f"semix study: report in {report}")
    text = report.read_text()
    start = text.find("## The goal")
    if start >= 0:
        print(text[start:].split("\n## ", 1)[0])
