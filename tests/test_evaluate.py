"""evaluate stage: metrics vs torchmetrics, temperature scaling, files, ensembles, OOD, corruptions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.classification import MulticlassCalibrationError

from models.classifiers import build_classifier
from pipeline.cli import main, run_stage
from shards.runs import save_weights
from shards.writer import ShardFolder

pytestmark = pytest.mark.usefixtures("one_thread")


def write_split(folder: Path, images: np.ndarray, labels: np.ndarray, names: list[str]) -> None:
    shards = ShardFolder(folder, folder.name)
    shards.write(
        0,
        (
            {"__key__": f"{folder.name}_{i:07d}", "png": im, "cls": int(y)}
            for i, (im, y) in enumerate(zip(images, labels))
        ),
    )
    shards.finish(1, kind="real", class_names=names, info={"split": folder.name, "image_size": 16})


def constructed_root(tmp: Path, n: int = 240, classes: int = 4) -> Path:
    """real/{val,test} with identical random samples and random labels, plus train/over/: a
    random digits-cnn with a 30x head, i.e. confident and mostly wrong (overconfident)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, classes, n)
    names = [f"c{k}" for k in range(classes)]
    root = tmp / "runs" / "const"
    for split in ("val", "test"):
        write_split(root / "real" / split, images, labels, names)
    torch.manual_seed(0)
    model = build_classifier("digits-cnn", classes, 3)
    with torch.no_grad():
        model.head.weight.mul_(30.0)
    meta = {
        "arch": model.arch_config(),
        "class_names": names,
        "image_size": 16,
        "normalize": {"mean": [0.5] * 3, "std": [0.25] * 3},
        "loss": "ce",
    }
    save_weights(root / "train" / "over", model.state_dict(), meta)
    return root


def evaluate(root: Path, *sets: str) -> Path:
    return run_stage("evaluate", "digits", [f"out={root.parent}", f"name={root.name}", *sets])


def test_metrics_match_torchmetrics_and_ts_does_not_hurt_an_overconfident_model(tmp_path):
    root = constructed_root(tmp_path)
    evaluate(root, "run=over")
    ev = json.loads((root / "train" / "over" / "metrics.json").read_text())["evaluation"]
    with np.load(root / "train" / "over" / "predictions.npz", allow_pickle=False) as npz:
        logits, labels = torch.from_numpy(npz["logits"]), torch.from_numpy(npz["labels"])
        assert float(npz["temperature"]) == ev["temperature"]
    probs = torch.softmax(logits.double(), dim=1)
    assert probs.max(dim=1).values.std() > 0.05  # confidences spread over several bins
    for norm, key in (("l1", "ece"), ("max", "mce")):
        ref = MulticlassCalibrationError(num_classes=4, n_bins=15, norm=norm)(probs, labels)
        assert ev["before_ts"][key] == pytest.approx(100 * float(ref), abs=1e-4)
    # overconfident (confidence far above accuracy): TS fitted on val (= test here) can only help
    b, a = ev["before_ts"], ev["after_ts"]
    assert b["oece"] > 20 and ev["temperature"] > 1
    assert a["ece"] <= b["ece"] and a["nll"] < b["nll"]
    assert a["top1"] == b["top1"]


def test_ood_corruptions_and_finetune_runs(tmp_path):
    root = constructed_root(tmp_path)
    # OOD: a prepared root of other images; corruptions: CIFAR-C layout, 5 severities x N
    rng = np.random.default_rng(1)
    write_split(
        tmp_path / "other" / "real" / "test",
        rng.integers(0, 40, (50, 16, 16, 3), dtype=np.uint8),
        np.zeros(50),
        ["x"],
    )
    corr = tmp_path / "corr"
    corr.mkdir()
    np.save(corr / "labels.npy", rng.integers(0, 4, 30))
    np.save(corr / "noise.npy", rng.integers(0, 256, (150, 12, 12, 3), dtype=np.uint8))  # resized
    shutil.copytree(root / "train" / "over", root / "finetune" / "ft")
    evaluate(root, "run=ft", f"ood={tmp_path / 'other'}", f"corruptions={corr}")
    ev = json.loads((root / "finetune" / "ft" / "metrics.json").read_text())["evaluation"]
    assert ev["stage"] == "finetune"
    for key in ("before_ts", "after_ts"):
        assert set(ev["ood"][key]) == {"msp_auroc", "msp_fpr95", "entropy_auroc"}
        assert all(0 <= v <= 100 for v in ev["ood"][key].values())
        assert set(ev["corruptions"][key]) == {"noise", "mean"}
        assert set(ev["corruptions"][key]["noise"]) == {"1", "2", "3", "4", "5"}
        assert ev["corruptions"][key]["mean"]["3"] == ev["corruptions"][key]["noise"]["3"]
    report = (root / "report.md").read_text()
    assert "OOD detection" in report and "Corruptions" in report
    with pytest.raises(ValueError, match="no trained weights"):
        evaluate(root, "run=ft", "stage_dir=train")


def test_trained_runs_ensemble_files_and_report(digits_root, tmp_path):
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    root = tmp_path / "digits"
    for run in ("a", "b"):
        run_stage(
            "train",
            "digits",
            [
                f"out={tmp_path}",
                f"run={run}",
                f"seed={run == 'b':d}",
                "epochs=2",
                "train_limit=256",
            ],
        )
    report = evaluate(root, "runs=a,b")
    assert report == root / "report.md"
    for folder in (root / "train" / "a", root / "train" / "b", root / "ensemble" / "a+b"):
        metrics = json.loads((folder / "metrics.json").read_text())
        ev = metrics["evaluation"]
        assert {"before_ts", "after_ts", "temperature"} <= set(ev)
        assert {
            "top1",
            "top5",
            "nll",
            "brier",
            "ece",
            "aece",
            "mce",
            "classwise_ece",
            "oece",
            "uece",
        } <= set(ev["before_ts"])
        assert ev["before_ts"]["oece"] + ev["before_ts"]["uece"] == pytest.approx(
            ev["before_ts"]["ece"]
        )
        with np.load(folder / "predictions.npz", allow_pickle=False) as npz:
            assert npz["logits"].shape == (359, 10) and npz["labels"].shape == (359,)
        assert (folder / "reliability.png").stat().st_size > 1000
    assert "train" in json.loads((root / "train" / "a" / "metrics.json").read_text())  # kept
    assert json.loads((root / "ensemble" / "a+b" / "metrics.json").read_text())["ensemble"][
        "members"
    ] == ["a", "b"]
    # the ensemble = mean softmax of the members
    p = [np.load(root / "train" / r / "predictions.npz")["logits"] for r in ("a", "b")]
    mean = (torch.softmax(torch.from_numpy(p[0]), 1) + torch.softmax(torch.from_numpy(p[1]), 1)) / 2
    ens = torch.softmax(
        torch.from_numpy(np.load(root / "ensemble" / "a+b" / "predictions.npz")["logits"]), 1
    )
    assert torch.allclose(ens, mean, atol=1e-5)
    rows = [line for line in report.read_text().splitlines() if line.startswith("| a")]
    assert len(rows) == 4  # a and a+b, before and after TS
    assert "| a+b | ensemble | ensemble |" in report.read_text()


def test_bad_input_gives_one_line_errors(tmp_path, capsys):
    root = constructed_root(tmp_path)
    base = ["evaluate", "--preset", "digits", "--set", f"out={root.parent}", f"name={root.name}"]
    assert main([*base, "run=a/b"]) == 2
    assert "plain folder name" in capsys.readouterr().err
    assert main([*base, "run=nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no trained weights" in err[0]
    assert main([*base, "run=over", f"ood={tmp_path / 'nothing'}"]) == 1
    assert "no prepared split" in capsys.readouterr().err


def test_report_groups_seeds_into_mean_and_std():
    from stages.evaluate import seed_summary

    def ev(top1, ece):
        return {"before_ts": {"top1": top1, "ece": ece, "nll": 0.1}, "after_ts": {"ece": ece / 2}}

    rows = [
        ("train", "ce-s0", ev(90.0, 4.0)),
        ("train", "ce-s1", ev(92.0, 6.0)),
        ("finetune", "ce-s0-maccal", ev(91.0, 2.0)),
        ("finetune", "ce-s1-maccal", ev(91.0, 2.0)),
        ("train", "encoder", ev(99.0, 1.0)),  # no seed suffix: not grouped
        ("train", "csm-s0", ev(93.0, 3.0)),  # a single seed: no summary row
    ]
    text = "\n".join(seed_summary(rows))
    assert "| ce | train | 2 | 91.00 ± 1.41 | 5.00 ± 1.41 | 0.100 ± 0.000 | 2.50 ± 0.71 |" in text
    assert "| ce-maccal | finetune | 2 | 91.00 ± 0.00 |" in text
    assert "encoder" not in text and "csm" not in text
    assert seed_summary(rows[4:]) == []


def test_without_run_every_trained_run_is_evaluated(tmp_path):
    root = constructed_root(tmp_path)
    shutil.copytree(root / "train" / "over", root / "train" / "second")
    shutil.copytree(root / "train" / "over", root / "finetune" / "over-maccal")
    evaluate(root)
    for folder in ("train/over", "train/second", "finetune/over-maccal"):
        assert "evaluation" in json.loads((root / folder / "metrics.json").read_text())
    assert not (root / "ensemble").exists()  # one by one, not as an ensemble
    report = (root / "report.md").read_text()
    assert all(f"| {n} |" in report for n in ("over", "second", "over-maccal"))
    empty = tmp_path / "runs" / "empty"
    shutil.copytree(root / "real", empty / "real")
    with pytest.raises(ValueError, match="no trained runs"):
        evaluate(empty)
