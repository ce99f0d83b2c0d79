"""`make demo`: does CSM data make a better-calibrated classifier? Measured, on digits.

After the generation chain (`make generate`), train the same classifier with plain
cross-entropy and with CSM (real CE + L2 to the soft labels of mixed/) for several seeds,
fine-tune both with MaC-Cal, train FeDLaS-LS and FeDLaS-MbLS from scratch, evaluate every
run (each into eval/<stage>/<run>/), and let eval/report.md put mean ± std side by side.
Whatever it shows is what we report. A rerun skips every run and evaluation already complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.logs import log
from pipeline.chain import chain, chain_configs, chain_fields, scoped_errors, split_sets
from pipeline.registry import resolve_stage_config, run_stage

SEEDS = (0, 1, 2)
FROM_SCRATCH = ("ce", "csm", "fedlas-ls", "fedlas-mbls")  # train losses
FINETUNED = (("ce", "maccal"), ("csm", "maccal"))  # (stage-I loss, fine-tuning objective)
STAGES = ("train", "finetune", "evaluate")  # what the demo runs after the chain


def demo_steps(preset: str, sets: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(stage, --set values) of every run after the chain, in order: per seed every loss from
    scratch, then MaC-Cal on top of ce and csm; then every evaluation."""
    # per-stage overrides (shared fields + `<stage>.key=value`); the run's own fields come last
    # and win, so the demo's seeds replace any shared seed=
    train_sets, finetune_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    evaluate_sets = split_sets(sets, "evaluate")
    steps: list[tuple[str, list[str]]] = []
    evaluated = []
    for seed in SEEDS:
        for loss in FROM_SCRATCH:
            name = f"{loss}-s{seed}"
            steps.append(("train", [*train_sets, f"run={name}", f"loss={loss}", f"seed={seed}"]))
            evaluated.append((name, "train"))
        for loss, objective in FINETUNED:
            run = f"{loss}-s{seed}"
            steps.append(("finetune", [*finetune_sets, f"run={run}", f"objective={objective}", f"seed={seed}"]))  # fmt: skip
            evaluated.append((f"{run}-{objective}", "finetune"))
    for name, stage in evaluated:
        steps.append(("evaluate", [*evaluate_sets, f"run={name}", f"stage_dir={stage}"]))
    return steps


def run_demo(preset: str, sets: Sequence[str]) -> None:
    # 1. The data: real/, the encoder, generator/, series/, mixed/ (skipped when complete).
    chain(preset, sets)
    # 2. Stage I: every loss, every seed; then MaC-Cal on top of ce and csm.
    # 3. Evaluate all (each run where it lives); eval/report.md groups seeds into mean ± std.
    report = None
    steps = demo_steps(preset, sets)
    for i, (stage, stage_sets) in enumerate(steps, 1):
        log.info("demo: %d/%d: %s %s", i, len(steps), stage, " ".join(stage_sets))
        with scoped_errors(stage):
            out = run_stage(stage, preset, stage_sets)
        report = out if stage == "evaluate" else report
    print(f"semix demo: report in {report}")
    if report is not None:
        text = report.read_text()
        start = text.find("## Mean ± std over seeds")
        print(text[start:].split("\n## ", 1)[0] if start >= 0 else text)


def fields_text(preset: str) -> str:
    """`semix demo --fields`: the chain's fields and those of the runs after it."""
    head = f"semix demo --preset {preset}: the chain, then train, finetune and evaluate runs"
    return "\n".join([head, *chain_fields(preset, STAGES)])


def resolved(preset: str, sets: Sequence[str]) -> dict[str, Any]:
    """`semix demo --print-config`: the chain's resolved steps and every run after it (each
    resolved, so a bad value fails here); nothing runs."""
    steps = demo_steps(preset, sets)
    for stage, stage_sets in steps:
        with scoped_errors(stage):
            resolve_stage_config(stage, preset, stage_sets)
    runs = [{"stage": stage, "sets": stage_sets} for stage, stage_sets in steps]
    return {"chain": chain_configs(preset, sets), "runs": runs}
