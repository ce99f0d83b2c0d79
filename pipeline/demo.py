"""`make demo`: does CSM data make a better-calibrated classifier? Measured, on digits.

After the generation chain (`make generate`), train the same classifier with plain
cross-entropy and with CSM (real CE + L2 to the soft labels of mixed/) for several seeds,
fine-tune both with MaC-Cal, train FeDLaS-LS and FeDLaS-MbLS from scratch, evaluate every
run (each into eval/<stage>/<run>/), and let eval/report.md put mean ± std side by side.
Whatever it shows is what we report. A rerun skips every run and evaluation already complete.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.runtime import log
from pipeline.chain import chain, split_sets
from pipeline.registry import run_stage

SEEDS = (0, 1, 2)
FROM_SCRATCH = ("ce", "csm", "fedlas-ls", "fedlas-mbls")  # train losses
FINETUNED = (("ce", "maccal"), ("csm", "maccal"))  # (stage-I loss, fine-tuning method)


def run_demo(preset: str, sets: Sequence[str]) -> None:
    # 1. The data: real/, the encoder, generator/, series/, mixed/ (skipped when complete).
    chain(preset, sets)
    # per-stage overrides (shared fields + `<stage>.key=value`); the run's own fields come last
    # and win, so the demo's seeds replace any shared seed=
    train_sets, finetune_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    evaluate_sets = split_sets(sets, "evaluate")
    evaluated = []
    # 2. Stage I: every loss, every seed; then MaC-Cal on top of ce and csm.
    for seed in SEEDS:
        for loss in FROM_SCRATCH:
            name = f"{loss}-s{seed}"
            log.info("demo: train %s", name)
            run_stage(
                "train",
                preset,
                [*train_sets, f"run={name}", f"loss={loss}", f"seed={seed}"],
            )
            evaluated.append((name, "train"))
        for loss, method in FINETUNED:
            log.info("demo: finetune %s-s%d with %s", loss, seed, method)
            run_stage(
                "finetune",
                preset,
                [
                    *finetune_sets,
                    f"run={loss}-s{seed}",
                    f"method={method}",
                    f"seed={seed}",
                ],
            )
            evaluated.append((f"{loss}-s{seed}-{method}", "finetune"))
    # 3. Evaluate all (each run where it lives); eval/report.md groups seeds into mean ± std.
    report = None
    for name, stage in evaluated:
        report = run_stage(
            "evaluate", preset, [*evaluate_sets, f"run={name}", f"stage_dir={stage}"]
        )
    print(f"semix demo: report in {report}")
    if report is not None:
        text = report.read_text()
        start = text.find("## Mean ± std over seeds")
        print(text[start:].split("\n## ", 1)[0] if start >= 0 else text)
