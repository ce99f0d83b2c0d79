"""evaluate: trained runs -> test metrics before/after temperature scaling, plots, report.md.

    python -m pipeline evaluate --preset digits --set run=ce
    python -m pipeline evaluate --preset digits --set runs=ce-s0,ce-s1,ce-s2   # + deep ensemble
    python -m pipeline evaluate --preset digits            # every complete user run, one by one

A run is read from train/<run>/ or finetune/<run>/ (train first; `stage_dir` pins one) and is
never written to. Metrics (docs/evaluate.md) are on real/test, before and after a temperature
fitted on real/val (`ts_criterion`: the val-NLL minimiser by default, or the lowest val ECE on
the grid 0.1..10), and after every post-hoc calibrator fitted on real/val (models/posthoc.py;
the best by cross-validated val NLL is named; stages/evaluate/metrics.py). Each evaluation is
a folder of its own (layout: shards/evals.py): eval/<stage>/<run>/ with metrics.json,
predictions.npz (test logits + labels, the best calibrator's test probabilities; numpy only,
load with allow_pickle=False), reliability.png and manifest.json (kind `eval`), written last.
Several runs also give their deep ensemble (mean softmax) in eval/ensemble/<a+b+c>/. Finally
eval/report.md is rebuilt from every complete evaluation (stages/evaluate/report.py). Runs the
stages trained as tools (annotate's encoder, fidelity judges, the study's tune-* runs:
`internal_runs`) are left out of a bare `evaluate` and of the report unless internal_runs=1.

Reruns: an evaluation whose manifest pins the same upstream digests (the run's, real/test's and
real/val's, the OOD set's and the corruptions' when used) and the same settings is skipped
before anything is loaded. A retrained run has another digest: its stale evaluation is redone
in a hidden sibling folder that replaces the old one in one rename.
"""

from stages.evaluate.stage import find_run, run, run_digest

__all__ = ["find_run", "run", "run_digest"]
