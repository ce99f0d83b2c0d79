"""`make study`: does semix calibrate? Every method x seed on one dataset, side by side.

    make study CLASSES=fashion-mnist
    python -m pipeline study --preset fashion-mnist --set study.seeds=0,1 study.jobs=2

1. The generation chain (`make generate`), when a method needs mixed/ (skipped when complete).
2. For every method and seed: train (or fine-tune its Stage-I run), then evaluate. Runs are
   subprocesses, `jobs` at a time (each stage pins its own CPU threads), so one slow run does
   not hold the others; a method that needs mixed/ waits for the chain, the others start at once.
3. study/study.json (one record per run + summaries) and study/report.md: mean ± std over seeds
   of every metric before and after temperature scaling, and a bootstrap 95 % interval of each
   method's ECE difference to `ce`; figures: reliability diagrams of ce vs csm (seeds pooled)
   and ECE per method with error bars.

Resumable: a run whose evaluation exists is not touched again, and train/finetune resume from
their own checkpoints, so a killed study reruns only what is missing. Every run writes its log
to study/logs/<run>.log.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.study_stats import Predictions, bootstrap_difference, summarize
from pipeline.chain import split_sets
from pipeline.core.config import ConfigError, parse_sets
from pipeline.core.io import atomic_write_json
from pipeline.core.runtime import derive_seed, log, progress
from pipeline.registry import resolve_stage_config
from pipeline.study_kway import kway_comparison, kway_root, prepare_kway
from pipeline.study_report import figures, write_report
from shards import evals
from shards.manifest import ShardError, read_manifest


class StudyError(ValueError):
    """A study run failed: the CLI prints it as one line naming the run's log."""


@dataclass(frozen=True)
class Method:
    """How one study method is made: a train run with these overrides, or a fine-tuning of
    another method's run (`base`)."""

    stage: str  # train | finetune
    sets: tuple[str, ...]
    base: str = ""  # finetune: the method whose run is fine-tuned
    needs_mixed: bool = False
    # k of the mixed set it trains on; k >= 3: a second chain into <root>-k<k>/ (kway_chain)
    mix_classes: int = 2


METHODS: dict[str, Method] = {
    "ce": Method("train", ("loss=ce",)),
    "csm": Method("train", ("loss=csm",), needs_mixed=True),
    # the CSM paper's ablations: ratio labels t_a = α (no re-annotation); CE on the mixed images
    "csm-ratio": Method("train", ("loss=csm", "csm_targets=ratio"), needs_mixed=True),
    "csm-ce": Method("train", ("loss=csm", "csm_mixed_loss=ce"), needs_mixed=True),
    # beyond the paper: series mixing 3 classes (simplex lattice m = 4), as many images as csm
    "csm3": Method("train", ("loss=csm",), needs_mixed=True, mix_classes=3),
    "ls": Method("train", ("loss=ls",)),
    "focal": Method("train", ("loss=focal",)),
    "mixup": Method("train", ("loss=mixup",)),
    "mmce": Method("train", ("loss=mmce",)),
    "fedlas-ls": Method("train", ("loss=fedlas-ls",)),
    "ce+maccal": Method("finetune", ("method=maccal",), base="ce"),
    "csm+maccal": Method("finetune", ("method=maccal",), base="csm", needs_mixed=True),
}
# the order runs start in: the comparison that matters most first
DEFAULT_METHODS = (
    "ce", "csm", "ls", "focal", "mixup", "fedlas-ls", "csm-ratio", "csm-ce",
    "ce+maccal", "csm+maccal",
)  # fmt: skip
METRICS = ("top1", "ece", "aece", "classwise_ece", "oece", "uece", "mce", "nll", "brier")


@dataclass(frozen=True)
class StudyConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    seeds: tuple[int, ...] = (0, 1, 2)
    jobs: int = 2  # runs at a time (subprocesses)
    bootstrap: int = 2000  # resamples for the 95 % intervals
    ts_criterion: str = "nll"  # evaluate's temperature-scaling criterion

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(
                f"unknown study method(s) {unknown}; choose from: {', '.join(METHODS)}"
            )
        if "ce" not in self.methods:
            raise ConfigError("study.methods must include ce: every method is compared with it")
        for m in self.methods:
            base = METHODS[m].base
            if base and base not in self.methods:
                raise ConfigError(f"study method {m} fine-tunes {base}: add {base} to methods")
            if METHODS[m].mix_classes > 2 and "csm" not in self.methods:
                raise ConfigError(f"study method {m} is compared with 2-way csm: add csm")
        if not self.seeds or self.jobs < 1 or self.bootstrap < 100:
            raise ConfigError("study needs >= 1 seed, jobs >= 1 and bootstrap >= 100")


def run_name(method: str, seed: int) -> str:
    """The run folder: <loss>-s<seed> for train, <base>-s<seed>-maccal for fine-tuning (the
    finetune stage appends its method), so evaluate's report groups seeds the same way."""
    m = METHODS[method]
    return f"{m.base}-s{seed}-maccal" if m.stage == "finetune" else f"{method}-s{seed}"


@dataclass
class Task:
    name: str
    steps: list[tuple[str, list[str]]]  # (stage or command, --set values), run in order
    after: set[str] = field(default_factory=set)
    done: bool = False
    # run in this process before the commands; returns extra --set values for the last step
    prepare: Callable[[], list[str]] | None = None

    def commands(self, preset: str, extra: Sequence[str] = ()) -> list[list[str]]:
        last = len(self.steps) - 1
        return [
            [sys.executable, "-m", "pipeline", stage, "--preset", preset, "--set", *sets]
            + (list(extra) if i == last else [])
            for i, (stage, sets) in enumerate(self.steps)
        ]


def _evaluated(folder: Path, criterion: str) -> bool:
    """A complete evaluation (eval/<stage>/<run>/, shards/evals.py) with this TS criterion, made
    from the run as it is now (same run digest). Otherwise the task runs: train/finetune skip a
    finished run and evaluate redoes only what is stale."""
    from stages.evaluate import run_digest, run_is_complete

    key = f"{folder.parent.name}/{folder.name}"  # <stage>/<run>, as evaluate names it
    run = folder.parent.parent.parent / key
    try:
        metrics = evals.read_metrics(folder)  # checked against its manifest; None: not there
        if not metrics or not run_is_complete(run):
            return False
        made_from = read_manifest(folder).upstream.get(key)
    except ShardError:  # damaged: the task's evaluate step redoes it
        return False
    return made_from == run_digest(run) and metrics["evaluation"].get("ts_criterion") == criterion


def plan(cfg: StudyConfig, preset: str, sets: Sequence[str], root: Path) -> list[Task]:
    """The chain (if needed) and one task per (method, seed): train/finetune + evaluate."""
    tasks: list[Task] = []
    needs_chain = any(METHODS[m].needs_mixed for m in cfg.methods)
    chain_sets = [s for s in sets if not s.startswith("study.")]
    if needs_chain:
        done = (root / "mixed" / "manifest.json").is_file()
        tasks.append(Task("chain", [("chain", chain_sets)], done=done))
    for k in sorted({METHODS[m].mix_classes for m in cfg.methods} - {2}):
        k_sets = [
            *(s for s in chain_sets if not s.startswith("name=")),
            f"name={kway_root(root, k).name}",
        ]
        done = (kway_root(root, k) / "mixed" / "manifest.json").is_file()
        prepare = functools.partial(prepare_kway, root, k)
        tasks.append(Task(f"chain-k{k}", [("chain", k_sets)], {"chain"}, done, prepare))
    train_sets, ft_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    eval_sets = [*split_sets(sets, "evaluate"), f"ts_criterion={cfg.ts_criterion}"]
    for method in cfg.methods:  # method by method (all its seeds), in the order given
        for seed in cfg.seeds:
            m, name = METHODS[method], run_name(method, seed)
            if m.stage == "train":
                make = ("train", [*train_sets, *m.sets, f"run={name}", f"seed={seed}"])
                if m.mix_classes > 2:
                    make[1].append(f"mixed={kway_root(root, m.mix_classes) / 'mixed'}")
            else:
                base = run_name(m.base, seed)
                make = ("finetune", [*ft_sets, *m.sets, f"run={base}", f"seed={seed}"])
            stage_dir = "train" if m.stage == "train" else "finetune"
            evaluate = ("evaluate", [*eval_sets, f"run={name}", f"stage_dir={stage_dir}"])
            after = {"chain"} if m.needs_mixed else set()
            if m.mix_classes > 2:
                after = {f"chain-k{m.mix_classes}"}
            if m.base:
                after.add(run_name(m.base, seed))
            done = _evaluated(evals.eval_dir(root, stage_dir, name), cfg.ts_criterion)
            tasks.append(Task(name, [make, evaluate], after, done))
    return tasks


def _execute(task: Task, preset: str, logs: Path) -> float:
    """Run the task's commands one after another, output to logs/<task>.log; seconds taken."""
    t0 = time.perf_counter()
    log_path = logs / f"{task.name}.log"
    extra = task.prepare() if task.prepare else []
    with open(log_path, "a", encoding="utf-8") as out:
        for cmd in task.commands(preset, extra):
            out.write(f"$ {' '.join(cmd[1:])}\n")
            out.flush()
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ
            ).returncode
            if rc != 0:
                raise StudyError(f"{task.name} failed (exit {rc}); see {log_path}")
    return time.perf_counter() - t0


def execute(tasks: list[Task], preset: str, jobs: int, logs: Path) -> dict[str, float]:
    """Run pending tasks `jobs` at a time in dependency order. A failed task fails the tasks
    that need it; the others go on. Raises at the end naming every failure."""
    logs.mkdir(parents=True, exist_ok=True)
    done = {t.name for t in tasks if t.done}
    pending = [t for t in tasks if not t.done]
    failed: dict[str, str] = {}
    seconds: dict[str, float] = {}
    running: dict[Future, Task] = {}
    with (
        ThreadPoolExecutor(jobs) as pool,
        progress(range(len(pending)), total=len(pending), desc="study", unit="run") as bar,
    ):
        while pending or running:
            for t in list(pending):
                if t.after & set(failed):
                    pending.remove(t)
                    failed[t.name] = f"skipped: needs {sorted(t.after & set(failed))}"
                    bar.update(1)
                elif t.after <= done and len(running) < jobs:
                    pending.remove(t)
                    running[pool.submit(_execute, t, preset, logs)] = t
                    log.info("study: started %s", t.name)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                t = running.pop(f)
                try:
                    seconds[t.name] = round(f.result(), 1)
                    done.add(t.name)
                    log.info("study: %s done in %.0f s", t.name, seconds[t.name])
                except StudyError as e:
                    failed[t.name] = str(e)
                    log.error("study: %s", e)
                bar.update(1)
    if failed:
        raise StudyError(
            f"{len(failed)} study run(s) failed: "
            + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items()))
        )
    return seconds


# ---------------------------------------------------------------- report


def collect(cfg: StudyConfig, root: Path) -> list[dict[str, Any]]:
    records = []
    for method in cfg.methods:
        stage_dir = "finetune" if METHODS[method].stage == "finetune" else "train"
        for seed in cfg.seeds:
            folder = evals.eval_dir(root, stage_dir, run_name(method, seed))
            ev = evals.read_metrics(folder)["evaluation"]
            records.append(
                {
                    "method": method,
                    "seed": seed,
                    "run": f"{stage_dir}/{folder.name}",
                    "temperature": ev["temperature"],
                    "ts_criterion": ev["ts_criterion"],
                    "temperature_on_edge": ev["temperature_on_edge"],
                    "before_ts": {k: ev["before_ts"][k] for k in METRICS},
                    "after_ts": {k: ev["after_ts"][k] for k in METRICS},
                }
            )
    return records


def run_study(preset: str, sets: Sequence[str]) -> Path:

    # 0. Study fields (`study.key=value`), the run root, and the plan. Every run's config is
    #    resolved up front (the chain validates its own), so a misspelt field fails now, not an
    #    hour in.
    study_sets = [s.removeprefix("study.") for s in sets if s.startswith("study.")]
    cfg = StudyConfig(**parse_sets(StudyConfig, study_sets))
    root = resolve_stage_config("train", preset, split_sets(sets, "train")).root
    out = root / "study"
    tasks = plan(cfg, preset, sets, root)
    for task in tasks:
        for stage, stage_sets in task.steps:
            if stage != "chain":
                resolve_stage_config(stage, preset, stage_sets)
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
    summary = summarize(records, METRICS)
    preds: dict[str, dict[str, list[Predictions]]] = {"before_ts": {}, "after_ts": {}}
    for r in records:
        path = root / evals.EVAL / r["run"] / evals.PREDICTIONS  # r["run"] = <stage>/<run>
        with np.load(path, allow_pickle=False) as z:
            logits, labels = z["logits"], z["labels"]
        for when, t in (("before_ts", 1.0), ("after_ts", r["temperature"])):
            preds[when].setdefault(r["method"], []).append(
                Predictions.from_logits(logits, labels, t)
            )
    rng = np.random.default_rng(derive_seed(0, "study-bootstrap"))
    boot = {when: bootstrap_difference(p, "ce", cfg.bootstrap, rng) for when, p in preds.items()}
    k_methods = {m: METHODS[m].mix_classes for m in cfg.methods if METHODS[m].mix_classes > 2}
    kway = kway_comparison(root, k_methods, preds, cfg.bootstrap, rng)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out / "study.json",
        {
            "dataset": root.name,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
            "records": records,
            "summary": summary,
            "ece_difference_to_ce": boot,
            "kway": kway,
            "task_seconds_this_invocation": seconds,
            "wall_seconds_this_invocation": round(time.perf_counter() - t0, 1),
        },
    )
    figures(cfg, root, out, preds["before_ts"], summary)
    report = write_report(cfg, root, out, records, summary, boot, kway)
    return report


def main(preset: str, sets: Sequence[str]) -> None:
    """`python -m pipeline study`: run it, then print where the report is and its goal."""
    report = run_study(preset, sets)
    print(f"semix study: report in {report}")
    text = report.read_text()
    start = text.find("## The goal")
    if start >= 0:
        print(text[start:].split("\n## ", 1)[0])
