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

from pipeline.study.command import estimate_text, fields_text, main, resolved, run_study

__all__ = ["estimate_text", "fields_text", "main", "resolved", "run_study"]
