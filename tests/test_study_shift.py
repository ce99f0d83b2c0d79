"""The study's robustness table (pipeline/study/robustness_stats.py): its plan, its records and its
statistics paired by image, on constructed inputs with a known answer."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.study import plan as study_plan
from pipeline.study import robustness_stats
from pipeline.study.records import robustness_entries
from pipeline.study.robustness_report import report_lines
from pipeline.study.robustness_stats import SEVERE, ShiftPredictions, comparisons
from pipeline.study.stats import Predictions, paired_difference


def _npz(path, logits, labels):
    np.savez(path, corruption_logits=logits.astype(np.float32), corruption_labels=labels)
    return path


def test_shift_metrics_are_the_mean_over_the_severe_sets(tmp_path):
    g = np.random.default_rng(0)
    logits, labels = g.normal(size=(3, 5, 400, 4)) * 3, g.integers(0, 4, 400)
    p = ShiftPredictions.load(_npz(tmp_path / "p.npz", logits, labels), temperature=1.7)
    sets = [
        Predictions.from_logits(logits[c, s - 1].astype(np.float32), labels, 1.7)
        for c in range(3)
        for s in SEVERE
    ]
    idx = g.integers(0, 400, 400)
    for i in (None, idx):
        assert p.ece(i) == pytest.approx(np.mean([q.ece(i) for q in sets]), abs=1e-12)
        assert p.nll(i) == pytest.approx(np.mean([q.nll(i) for q in sets]), abs=1e-12)


def test_paired_bootstrap_under_shift_separates_a_calmer_method(tmp_path):
    """Seed k of both methods shares its logits' noise; the calm one is 4x less confident:
    better calibrated (these logits are far overconfident), by an interval below 0."""
    g = np.random.default_rng(1)
    labels = g.integers(0, 3, 300)
    runs: dict[str, dict[int, ShiftPredictions]] = {"ce": {}, "calm": {}}
    for seed in range(3):
        logits = g.normal(size=(2, 5, 300, 3))
        logits[..., np.arange(300), labels] += 1.0
        for name, scale in (("ce", 8.0), ("calm", 2.0)):
            path = _npz(tmp_path / f"{name}{seed}.npz", logits * scale, labels)
            runs[name][seed] = ShiftPredictions.load(path, 1.0)
    r = paired_difference(runs, "calm", "ce", 300, np.random.default_rng(0), "ece")  # type: ignore[arg-type]
    assert r["ci95"][1] < 0 and r["verdict"] == "better" and r["relative"] < -0.2


def test_record_reads_the_evaluations_shift_and_ood_sections():
    sev = {str(s): {"ece": s, "nll": 0.1 * s, "brier": 0.0, "top1": 90 - s} for s in range(1, 6)}
    ev = {
        "corruptions": {
            w: {"noise": sev, "blur": sev, "mean": sev} for w in ("before_ts", "after_ts")
        },
        "ood": {
            "uniform": {
                "before_ts": {
                    "msp_auroc": 80.0,
                    "msp_fpr95": 50.0,
                    "msp_aupr_in": 1,
                    "msp_aupr_out": 2,
                },
                "after_ts": {"msp_auroc": 81.0},
            }
        },
    }
    r = robustness_entries(ev)
    assert r["shift"]["after_ts"]["3"]["ece"] == 3
    assert set(r["shift"]["per_corruption"]["before_ts"]) == {"noise", "blur"}
    assert r["ood"]["uniform"] == {
        "auroc": 80.0, "fpr95": 50.0, "aupr_in": 1, "aupr_out": 2, "auroc_after_ts": 81.0
    }  # fmt: skip


def test_the_plan_builds_the_sets_first_and_every_evaluation_reads_them(tmp_path):
    tasks, reads = study_plan.robustness_tasks(
        tmp_path / "fashion-mnist", "fashion-mnist", {"chain"}
    )
    assert [t.name for t in tasks] == ["shift", "ood"] and all(t.after == {"chain"} for t in tasks)
    assert tasks[0].steps == [("shift", [f"limit={study_plan.SHIFT_IMAGES}"])]
    assert tasks[1].steps == [("ood", ["sets=digits,uniform"])]
    assert reads[0].endswith("shift/test-c") and reads[1].count(",") == 1
    # scikit-learn's digits is no OOD set for the digits preset
    assert study_plan.ood_sets("digits") == ("uniform",)
    assert comparisons(["ce", "csm", "ls"]) == [
        ("after_ts", "ece", "csm", "ce"), ("after_ts", "nll", "csm", "ce"),
        ("after_ts", "ece", "ls", "ce"), ("after_ts", "nll", "ls", "ce"),
        ("before_ts", "ece", "csm", "ce"),
    ]  # fmt: skip


def test_every_run_waits_for_the_sets_and_is_redone_until_it_read_them(tmp_path):
    from test_study import _run_and_evaluation

    from pipeline.study.config import StudyConfig
    from pipeline.study.plan import plan

    cfg = StudyConfig(stack=False, methods=("ce", "csm-ratio"), seeds=(0,), tune=False)
    tasks = {t.name: t for t in plan(cfg, "digits", [], tmp_path)}
    assert list(tasks) == ["prepare", "chain", "shift", "ood", "ce-s0", "csm-ratio-s0"]
    # the sets read real/ only: they (and the runs that need no mixed set) start beside the chain
    assert tasks["shift"].after == tasks["ood"].after == tasks["chain"].after == {"prepare"}
    assert tasks["ce-s0"].after == {"shift", "ood"}
    assert tasks["csm-ratio-s0"].after == {"chain", "shift", "ood"}
    evaluate = tasks["ce-s0"].steps[1][1]
    assert f"corruptions={tmp_path / 'shift' / 'test-c'}" in evaluate
    assert f"ood={tmp_path / 'ood' / 'uniform'}" in evaluate
    # an evaluation of the clean test split only is not done: its evaluate step runs again
    _run_and_evaluation(tmp_path, "train", "ce-s0", "nll")
    assert not next(t for t in plan(cfg, "digits", [], tmp_path) if t.name == "ce-s0").done
    quiet = StudyConfig(
        stack=False, methods=("ce", "csm-ratio"), seeds=(0,), tune=False, robustness=False
    )
    assert next(t for t in plan(quiet, "digits", [], tmp_path) if t.name == "ce-s0").done


def _ood_npz(path, test, ood, labels):
    np.savez(path, logits=test.astype(np.float32), labels=labels, ood_logits_noise=ood)
    return path


def test_auroc_shortfall_is_one_minus_sklearns_auroc_with_ties_and_resampled_images(tmp_path):
    from sklearn.metrics import roc_auc_score

    g = np.random.default_rng(2)
    labels = g.integers(0, 3, 60)
    test = np.round(g.normal(size=(60, 3)) * 2, 1)  # rounded: tied scores, counted half
    ood = np.round(g.normal(size=(25, 3)), 1).astype(np.float32)
    p = robustness_stats.OODPredictions.load(
        _ood_npz(tmp_path / "p.npz", test, ood, labels), "noise"
    )
    msp = np.concatenate([
        robustness_stats.softmax(test.astype(np.float32)).max(axis=1), robustness_stats.softmax(ood).max(axis=1)
    ])  # fmt: skip
    is_id = np.r_[np.ones(60), np.zeros(25)]
    assert len(np.unique(msp)) < len(msp)  # the case has ties
    assert p.auroc_shortfall() == pytest.approx(1 - roc_auc_score(is_id, msp), abs=1e-12)
    idx = g.integers(0, 85, 85)  # a bootstrap resample: repeated images count their multiplicity
    want = 1 - roc_auc_score(is_id[idx], msp[idx])
    assert p.auroc_shortfall(idx) == pytest.approx(want, abs=1e-12)


def test_ood_paired_finds_the_method_that_separates_the_sets_better(tmp_path):
    """Seed k of both methods shares its test logits; the sharp method is confident on test
    images and not on OOD ones, the blunt one equally on both: AUROC higher, interval apart."""
    g = np.random.default_rng(3)
    labels = g.integers(0, 4, 200)
    records = []
    for seed in range(3):
        test = g.normal(size=(200, 4))
        test[np.arange(200), labels] += 3.0
        ood = g.normal(size=(80, 4))
        for method, ood_scale in (("ce", 3.0), ("sharp", 0.5)):
            run = f"train/{method}-s{seed}"
            folder = tmp_path / "eval" / run
            folder.mkdir(parents=True)
            _ood_npz(folder / "predictions.npz", test, (ood * ood_scale).astype(np.float32), labels)
            record = {"run": run, "method": method, "seed": seed, "ood": {"noise": {}}}
            if method == "sharp":  # trained on a mixed set of its own: the top-level unit
                record["mixed_set"] = f"m{seed}"
            records.append(record)
    out = robustness_stats.ood_paired(
        tmp_path, records, ["ce", "sharp"], 300, robustness_stats.shift_rng
    )
    r = out["noise"]["sharp"]
    assert r["metric"] == "auroc_shortfall" and r["seeds"] == [0, 1, 2] and r["n_test"] == 280
    assert r["difference"] < 0 and r["ci95"][1] < 0 and r["verdict"] == "better"
    assert r["units"] == {"level": "mixed_set", "groups": [[0], [1], [2]]}
    lines = "\n".join(report_lines(
        [{"method": m, "shift": {"after_ts": {str(s): {"ece": 1, "nll": 1, "top1": 1}
                                              for s in range(1, 6)}}, "ood": {}}
         for m in ("ce", "sharp")], {}, out,
    ))  # fmt: skip
    row = next(line for line in lines.splitlines() if line.startswith("| noise | sharp − ce"))
    assert f"{-r['difference']:+.2f}" in row and "| better |" in row  # AUROC up
