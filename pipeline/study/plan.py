"""A study's plan: its config from `study.key=value`, then every task it runs in order (the data,
the chains of its mixed sets, the tuning grids, the robustness table's shift and OOD sets, a
train or fine-tuning run per method and seed, each evaluated), each task's config checked
before any task starts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from core.config import parse_sets
from pipeline.chain import SPREAD, check_chain, scoped_errors, split_sets
from pipeline.registry import resolve_stage_config
from pipeline.study.cells import (
    CELL_FIT,
    GENERATOR,
    Cell,
    CellReads,
    candidates,
    cell_tasks,
    generator_task,
    prepare_set0,
    reference_steps,
)
from pipeline.study.config import CELL_FIT_SEED, METHODS, StudyConfig, Task, cpu_count, run_name
from pipeline.study.mixed_sets import (
    FIT_UPSTREAM,
    chain_task,
    fit_variant,
    link_complete,
    prepare_set,
    set_variant,
    variant_root,
)
from pipeline.study.protocol import check_same
from pipeline.study.tuning import chosen_groups, chosen_sets, plan_groups, tune_seeds
from pipeline.study.tuning_plan import tuning_tasks
from shards import evals
from shards.manifest import ShardError, is_complete, read_manifest
from shards.writer import check_config
from stages.presets import chain_steps, reader

# ---------------------------------------------------------------- the robustness table's tasks

SHIFT_IMAGES = 2000  # test images under each corruption and severity (x 5 x 11 per run)
OOD_SETS = ("digits", "uniform")  # a far-OOD set of real images and a synthetic one


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
    """The chain (if needed), the tuning grids the methods need (pipeline/study/tuning.py) and
    one task per (method, seed): train/finetune + evaluate."""
    needs_chain = any(METHODS[m].needs_mixed for m in cfg.methods)
    chain_sets = [s for s in sets if not s.startswith("study.")]
    tasks: list[Task] = [data_task(preset, chain_sets, root)]
    train_sets, ft_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    cells = study_cells(cfg, preset, chain_sets)
    base_fit_seed = fit_seed(preset, chain_sets) if needs_chain else 0
    # the cells are chosen once, on a fit of their own that no comparison uses (docs/study.md)
    cell_fit = variant_root(root, CELL_FIT)
    cell_sets = [f"fit-generator.seed={base_fit_seed + CELL_FIT_SEED}"]
    steps = reference_steps(preset, chain_sets) if cells else 25
    reads = CellReads(root, tune_seeds(cfg), cell_fit, cell_sets, steps)  # this invocation's
    # the fits some csm-family seed trains on (fit 0 always: the chain's); a fit no run reads
    # (fewer seeds than fits) is not fitted
    used = {cfg.fit_of(m, s) or 0 for m in cfg.methods if METHODS[m].needs_mixed
            for s in cfg.seeds_of(m)}  # fmt: skip
    fit_names = {f: fit_task_name(f) for f in sorted(used | {0})}
    if needs_chain:
        done = is_complete(root / "mixed")
        if (
            cells
        ):  # the encoder first, the fits, the cell fit's kept cells tried; sets at the choice
            tasks.append(generator_task(preset, chain_sets, root, DATA, fit=False))
            tasks.append(fit_task(preset, chain_sets, root, cell_fit, cell_sets, "fit-cells"))
            tasks += [fit_task(preset, chain_sets, root, fit_root(root, f),
                               fit_sets(base_fit_seed, f), fit_names[f]) for f in fit_names]  # fmt: skip
            tried = cell_tasks(reads, cells, chain_sets, train_sets, after="fit-cells")
            tasks += tried.in_order()
            after = {t.name for t in tried.runs} | {fit_names[0]}
            prepare0 = functools.partial(prepare_set0, reads)
            tasks.append(Task("chain", [("chain", chain_sets)], after, done, prepare0))
        else:  # the chain fits fit 0; the other fits wait for its encoder
            tasks.append(Task("chain", [("chain", chain_sets)], {DATA}, done))
            fit_names[0] = "chain"
            tasks += [fit_task(preset, chain_sets, root, fit_root(root, f),
                               fit_sets(base_fit_seed, f), fit_names[f], after="chain")
                      for f in fit_names if f]  # fmt: skip

    draws = cfg.fits * cfg.mixed_sets
    gen_seed = generate_seed(preset, chain_sets) if needs_chain and draws > 1 else 0

    def set_chain(variant: str, index: int, fit: int) -> Task:
        """The chain of a family's mixed set `index` of generator fit `fit` into its own root
        (set 0 of fit 0 of csm: "chain"), at the chosen cell when the study chooses it."""
        name = set_variant(variant, index, fit)
        v_root = variant_root(root, name)
        v_sets = [*(s for s in chain_sets if not s.startswith("name=")), f"name={v_root.name}"]
        done = is_complete(v_root / "mixed")
        prepare = functools.partial(
            prepare_set, root, variant, index, gen_seed, fit, cfg.mixed_sets,
            fit_sets(base_fit_seed, fit),
        )  # fmt: skip
        if cells:
            prepare = functools.partial(_at_chosen_cell, prepare, reads)
        after = {"chain", fit_names[fit]}
        return Task(chain_task(name), [("chain", v_sets)], after, done, prepare)

    tuned = tuning_tasks(cfg, root, sets) if cfg.tune else {}
    # evaluate pinned to 1 CPU thread unless the command line says otherwise: `jobs` runs fill
    # the cores, and torch's default (every core in each) oversubscribes them (4-8x slower
    # here); pinned, the numbers do not depend on the machine's core count either
    eval_sets = ["cpu_threads=1", *split_sets(sets, "evaluate"), f"ts_criterion={cfg.ts_criterion}"]
    robust: set[str] = set()  # the tasks every evaluation waits for: the shift and OOD sets
    if cfg.robustness:
        # the shift and OOD sets read real/ only: made beside the chain
        extra, reads = robustness_tasks(root, preset, {DATA}, chain_sets)
        tasks += extra
        eval_sets += reads
        robust = {t.name for t in extra}
    # method by method (all its seeds), in the order given; a variant's chain and a tuning
    # grid join the list just before the first method that needs them. Tasks start in list
    # order once what they need is done, so the methods given first are done first.
    for method in cfg.methods:
        variant = METHODS[method].variant
        if METHODS[method].needs_mixed:  # every (fit, mixed set) its seeds train on
            units = {
                (cfg.fit_of(method, s), cfg.mixed_set(method, s)) for s in cfg.seeds_of(method)
            }
            for fit, index in sorted(units):  # type: ignore[type-var]
                name = chain_task(set_variant(variant, index, fit))
                if not any(t.name == name for t in tasks):
                    tasks.append(set_chain(variant, index, fit))
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
                stacks.setdefault(mixed_of(cfg, method, seed), []).append(seed)
            for mixed, seeds in stacks.items():
                after = ({chain_task(mixed)} if m.needs_mixed else set()) | tuning
                tasks.append(stack_task(root, method, mixed, seeds, train_sets, after, prepare))
        for seed in cfg.seeds_of(method):
            name = run_name(method, seed)
            mixed = mixed_of(cfg, method, seed)
            stage_dir = "train" if m.stage == "train" else "finetune"
            evaluate = ("evaluate", [*eval_sets, f"run={name}", f"stage_dir={stage_dir}"])
            after = ({chain_task(mixed)} if m.needs_mixed else set()) | robust | tuning
            if m.base:
                after.add(run_name(m.base, seed))
            folder = evals.eval_dir(root, stage_dir, name)
            done = _evaluated(folder, cfg.ts_criterion) and (
                not cfg.robustness or read_them(folder, preset)
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
    cpus = cpu_count()
    for t in tasks:
        t.cores = task_cores(preset, t.steps, cpus)
    return tasks


@functools.lru_cache(maxsize=1024)
def _step_cores(stage: str, preset: str, sets: tuple[str, ...], cpus: int) -> int:
    with scoped_errors(stage):
        threads = resolve_stage_config(stage, preset, list(sets)).cpu_threads
    return threads if 0 < threads < cpus else cpus


def task_cores(preset: str, steps: Sequence[tuple[str, Sequence[str]]], cpus: int) -> int:
    """The cores a task's commands keep busy at once, from its steps' resolved configs: a
    stage's `cpu_threads` (0, torch's default: every core; never more than the machine), the
    most over its steps (they run one after another). A chain counts every step of the
    preset's chain with the values the chain gives it, and a step it spreads over one process
    per core (pipeline/chain.py SPREAD: generate) as every core."""
    most = 1
    for stage, sets in steps:
        if stage == "chain":
            for sub, extra in chain_steps(preset):
                if sub in SPREAD:
                    return cpus
                most = max(most, _step_cores(sub, preset, (*extra, *split_sets(sets, sub)), cpus))
        else:
            most = max(most, _step_cores(stage, preset, tuple(sets), cpus))
    return min(most, cpus)


def study_cells(cfg: StudyConfig, preset: str, chain_sets: Sequence[str]) -> list[Cell]:
    """The generator cells the study tries (pipeline/study/cells.py): its chain's fit-generator
    grid when the study tunes and chooses the cell; [] when it takes the fit's cell."""
    if not (cfg.tune and cfg.cells and any(METHODS[m].needs_mixed for m in cfg.methods)):
        return []
    return candidates(preset, chain_sets)


def mixed_of(cfg: StudyConfig, method: str, seed: int) -> str:
    """The variant root of the mixed set a run trains on ("": csm's <root>, also for a method
    that reads none)."""
    fit, index = cfg.fit_of(method, seed) or 0, cfg.mixed_set(method, seed) or 0
    return set_variant(METHODS[method].variant, index, fit)


def fit_root(root: Path, fit: int) -> Path:
    """Generator fit `fit`'s chain root: <root> for fit 0, <root>-f<f> after it."""
    return variant_root(root, fit_variant(fit)) if fit else root


def fit_sets(base_seed: int, fit: int) -> list[str]:
    """The chain-scope settings of fit `fit`: its fit-generator seed (the chain's + fit; fit 0
    the chain's own, so its config is the chain's)."""
    return [f"fit-generator.seed={base_seed + fit}"] if fit else []


def fit_task_name(fit: int) -> str:
    return f"fit-f{fit}"


def fit_seed(preset: str, chain_sets: Sequence[str]) -> int:
    """The seed of the chain's fit-generator step (fit 0's; fit f's is it + f)."""
    extra = dict(chain_steps(preset)).get("fit-generator")
    if extra is None:
        return 0
    with scoped_errors("fit-generator"):
        return resolve_stage_config(
            "fit-generator", preset, [*extra, *split_sets(chain_sets, "fit-generator")]
        ).seed


def fit_task(
    preset: str,
    chain_sets: Sequence[str],
    root: Path,
    dst: Path,
    sets: Sequence[str],
    name: str,
    after: str = GENERATOR,
) -> Task:
    """fit-generator into chain root `dst` with the chain-scope `sets` (its seed), once the
    encoder and judges it reads exist: they, and real/, are shared from <root> by link, the
    fit's own generator/ is its own."""
    extra = dict(chain_steps(preset)).get("fit-generator", ())
    own = split_sets([*chain_sets, *sets], "fit-generator")
    at = [] if dst == root else [f"name={dst.name}"]
    step = ("fit-generator", [*extra, *own, *at])
    done = is_complete(dst / "generator")

    def prepare() -> list[str]:
        if dst != root:
            for rel in FIT_UPSTREAM:
                link_complete(root / rel, dst / rel)
        return []

    return Task(name, [step], {after}, done, prepare)


def _at_chosen_cell(prepare: Callable[[], list[str]], reads: CellReads) -> list[str]:
    return [*prepare(), *reads.chosen().sets()]


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


def setup(
    preset: str, sets: Sequence[str], data: bool = True
) -> tuple[StudyConfig, Path, list[Task]]:
    """Study fields (`study.key=value`), the run root, and the plan. Every task's config is
    checked up front (check_tasks; `data`: the data source too, which --print-config, a
    machine without the data, leaves out), so a misspelt field fails now, not an hour in.
    Reads only."""
    study_sets = [s.removeprefix("study.") for s in sets if s.startswith("study.")]
    cfg = StudyConfig(**parse_sets(StudyConfig, study_sets, lambda key: f"study.{key}"))
    check_same(cfg.protocol)
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
    a preset whose generator fields differ from the chain's (fashion-mnist's prediction_type, for
    one) would otherwise be reported on with another generator's data. Refused in one line
    naming the fields and both fixes."""
    folder = root / "generator"
    if not (folder / "config.json").is_file():
        return  # this chain has no in-house generator (sd, dit, edm backends)
    with scoped_errors("fit-generator"):
        cfg = resolve_stage_config("fit-generator", preset, split_sets(chain_sets, "fit-generator"))
    check_config(
        folder,
        cfg.recorded(),
        fix="the study reuses a done chain as it is: add --set fit-generator.<field>=<the value "
        "it has; unset = the default before the field existed, noise.prediction_type=epsilon> to "
        "report on it, or set out= to a new root to build the chain anew",
    )
