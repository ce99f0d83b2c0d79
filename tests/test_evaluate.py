"""evaluate stage: metrics vs torchmetrics, temperature scaling, files, ensembles, OOD, corruptions,
its own eval/ folders (run folders untouched, reruns skip, stale evaluations redone)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import snapshot
from torchmetrics.classification import MulticlassCalibrationError

from core.io import atomic_write_json
from models.calibration import ece
from models.classifiers import build_classifier
from pipeline.cli import main
from pipeline.registry import run_stage
from shards import evals
from shards.manifest import read_manifest
from shards.runs import save_weights
from shards.writer import ShardFolder

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("evaluate")]


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


def finish_run(folder: Path, loss: str = "ce") -> None:
    """Finish a hand-made run folder the way the training loop does: metrics.json, then the run
    manifest last (shards.manifest.is_complete reads the manifest)."""
    from shards.runs import finish_run as write_run_manifest

    atomic_write_json(folder / "metrics.json", {"train": {"loss": loss, "finished": True}})
    meta = json.loads((folder / "model.json").read_text())
    write_run_manifest(folder, meta["class_names"], {})


def save_run(folder: Path, model: torch.nn.Module, names: list[str]) -> None:
    meta = {
        "arch": model.arch_config(),
        "class_names": names,
        "image_size": 16,
        "normalize": {"mean": [0.5] * 3, "std": [0.25] * 3},
        "loss": "ce",
    }
    save_weights(folder, model.state_dict(), meta)
    finish_run(folder)


def tree_digest(folder: Path) -> str:
    """sha256 over every file under folder: relative names and bytes."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def eval_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


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
    save_run(root / "train" / "over", model, names)
    return root


def evaluate(root: Path, *sets: str) -> Path:
    return run_stage("evaluate", "digits", [f"out={root.parent}", f"name={root.name}", *sets])


@pytest.fixture(scope="module")
def evaluated(one_thread, tmp_path_factory) -> Path:
    """constructed_root with run=over evaluated: the start of several tests, made once.
    Read-only: a test that writes copies it first (_copy; an evaluation's bytes do not
    depend on where its root is, test_same_inputs_give_the_same_bytes_anywhere)."""
    root = constructed_root(tmp_path_factory.mktemp("evaluated"))
    evaluate(root, "run=over")
    return root


def _copy(evaluated: Path, tmp: Path) -> Path:
    """A writable copy of `evaluated` (copy2: the files keep their times)."""
    return Path(shutil.copytree(evaluated, tmp / "runs" / evaluated.name))


def test_metrics_match_torchmetrics_and_ts_does_not_hurt_an_overconfident_model(evaluated):
    root = evaluated
    ev = json.loads((root / "eval" / "train" / "over" / "metrics.json").read_text())["evaluation"]
    with np.load(root / "eval" / "train" / "over" / "predictions.npz", allow_pickle=False) as npz:
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


def test_new_metrics_and_every_posthoc_calibrator_fitted_on_val(evaluated):
    from models.calibration import METRIC_KEYS, probability_metrics
    from models.posthoc import POSTHOC

    root = evaluated
    folder = root / "eval" / "train" / "over"
    ev = json.loads((folder / "metrics.json").read_text())["evaluation"]
    assert set(ev["before_ts"]) == set(ev["after_ts"]) == set(METRIC_KEYS)  # json sorts keys
    post = ev["posthoc"]
    assert set(post["after"]) == set(post["val_nll"]) == set(POSTHOC)
    assert post["folds"] == 5 and "cross-validated" in post["criterion"]
    assert post["best"] == min(post["val_nll"], key=post["val_nll"].__getitem__)
    # the post-hoc temperature is the NLL criterion's T: the same numbers as after TS
    assert post["after"]["temperature"] == pytest.approx(ev["after_ts"], rel=1e-6)
    for name, metrics in post["after"].items():
        assert set(metrics) == set(METRIC_KEYS), name
        assert metrics["top1"] == pytest.approx(ev["before_ts"]["top1"], abs=15), name
    # the overconfident run: every calibrator, fitted on val (= test here), lowers the NLL
    assert all(m["nll"] < ev["before_ts"]["nll"] for m in post["after"].values())
    with np.load(folder / "predictions.npz", allow_pickle=False) as npz:
        probs, labels = torch.from_numpy(npz["posthoc_probs"]), torch.from_numpy(npz["labels"])
        assert str(npz["posthoc_method"]) == post["best"]
    again = probability_metrics(probs.double() / probs.double().sum(1, keepdim=True), labels)
    assert again["ece"] == pytest.approx(post["after"][post["best"]]["ece"], abs=1e-4)
    report = (root / "eval" / "report.md").read_text()
    assert "## More metrics" in report and "## Post-hoc calibrators" in report
    assert f"{post['after'][post['best']]['ece']:.2f}*" in report  # the best one marked


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
    ev = json.loads((root / "eval" / "finetune" / "ft" / "metrics.json").read_text())["evaluation"]
    assert ev["stage"] == "finetune"
    scores = ("msp", "entropy", "maxlogit", "energy")  # one network: all four
    stats = ("auroc", "fpr95", "aupr_in", "aupr_out")
    for key in ("before_ts", "after_ts"):
        assert set(ev["ood"]["other"][key]) == {f"{n}_{s}" for n in scores for s in stats}
        assert all(0 <= v <= 100 for v in ev["ood"]["other"][key].values())
    assert ev["corruptions"]["posthoc_method"] == ev["posthoc"]["best"]
    for key in ("before_ts", "after_ts", "after_posthoc"):
        assert set(ev["corruptions"][key]) == {"noise", "mean"}
        assert set(ev["corruptions"][key]["noise"]) == {"1", "2", "3", "4", "5"}
        assert ev["corruptions"][key]["mean"]["3"] == ev["corruptions"][key]["noise"]["3"]
        assert set(ev["corruptions"][key]["noise"]["2"]) == {"ece", "nll", "brier", "top1"}
    before, after = (ev["corruptions"][k]["noise"]["4"] for k in ("before_ts", "after_ts"))
    assert after["top1"] == before["top1"]  # TS keeps the ranking
    # the corrupted images' logits are kept, for statistics paired by image: they give the numbers
    with np.load(root / "eval" / "finetune" / "ft" / "predictions.npz") as z:
        shifted, y = (
            torch.from_numpy(z["corruption_logits"]),
            torch.from_numpy(z["corruption_labels"]),
        )
        assert shifted.shape == (1, 5, 30, 4) and list(z["corruption_names"]) == ["noise"]
        test_logits, ood_logits = z["logits"], z[evals.ood_logits_key("other")]
    # and the OOD set's, which give its AUROC (max softmax, test images positive)
    from sklearn.metrics import roc_auc_score

    msp = torch.softmax(torch.from_numpy(np.concatenate([test_logits, ood_logits])), 1).amax(1)
    is_test = np.r_[np.ones(len(test_logits)), np.zeros(len(ood_logits))]
    want = 100 * roc_auc_score(is_test, msp.numpy())
    assert ev["ood"]["other"]["before_ts"]["msp_auroc"] == pytest.approx(want, abs=1e-4)
    assert 100 * ece(shifted[0, 3].double(), y) == pytest.approx(before["ece"], abs=1e-4)
    report = (root / "eval" / "report.md").read_text()
    assert "OOD detection" in report and "Corruptions" in report
    upstream = read_manifest(root / "eval" / "finetune" / "ft").upstream
    assert set(upstream) == {"finetune/ft", "real/test", "real/val", "ood/other", "corruptions"}
    # pinned to the other folder: the run is named where it is, with the command that works
    with pytest.raises(ValueError, match=r"is not in .*/train/ft but in .*/finetune/ft: evaluate"):
        evaluate(root, "run=ft", "stage_dir=train")


def test_a_grey_corruption_set_is_copied_as_its_rgb_view(tmp_path):
    from stages.evaluate.metrics import _copied

    rng = np.random.default_rng(3)
    np.save(tmp_path / "labels.npy", rng.integers(0, 4, 6))
    np.save(tmp_path / "blur.npy", rng.integers(0, 256, (30, 5, 4, 1), dtype=np.uint8))
    np.save(tmp_path / "rgb.npy", rng.integers(0, 256, (30, 5, 4, 3), dtype=np.uint8))
    sets, _ = evals.corruption_sets(str(tmp_path))
    for name in ("blur", "rgb"):
        view = sets[name][12:18]  # severity 3
        copy = _copied(view)
        assert copy.flags.writeable and copy.flags.c_contiguous and copy.shape == (6, 5, 4, 3)
        np.testing.assert_array_equal(copy, np.array(view))
    grey = np.load(tmp_path / "blur.npy")[12:18]
    np.testing.assert_array_equal(_copied(sets["blur"][12:18]), np.concatenate([grey] * 3, -1))


def test_evaluate_leaves_trained_runs_byte_identical_and_writes_eval_folders(digits_root, tmp_path):
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    root = tmp_path / "digits"
    for run in ("a", "b"):
        sets = [f"out={tmp_path}", f"run={run}", f"seed={run == 'b':d}", "epochs=2"]
        run_stage("train", "digits", [*sets, "train_limit=256"])
    runs = {r: (tree_digest(root / "train" / r), snapshot(root / "train" / r)) for r in "ab"}
    report = evaluate(root, "runs=a,b")
    assert report == root / "eval" / "report.md"
    # evaluate reads the run folders and writes none of their bytes (names, contents, mtimes)
    for r in "ab":
        assert (tree_digest(root / "train" / r), snapshot(root / "train" / r)) == runs[r]
    evals = {
        "a": root / "eval" / "train" / "a",
        "b": root / "eval" / "train" / "b",
        "a+b": root / "eval" / "ensemble" / "a+b",
    }
    for name, folder in evals.items():
        files = sorted(p.name for p in folder.iterdir())
        assert files == ["manifest.json", "metrics.json", "predictions.npz", "reliability.png"]
        manifest = read_manifest(folder)
        assert manifest.kind == "eval" and manifest.class_names == tuple("0123456789")
        members = ["a", "b"] if name == "a+b" else [name]
        assert set(manifest.upstream) == {"real/test", "real/val", *(f"train/{m}" for m in members)}
        for f, rec in manifest.info["files"].items():  # the manifest pins every file
            assert hashlib.sha256((folder / f).read_bytes()).hexdigest() == rec["sha256"]
        ev = json.loads((folder / "metrics.json").read_text())["evaluation"]
        metrics = {"top1", "top5", "nll", "brier", "ece", "aece", "mce", "classwise_ece"}
        assert {"oece", "uece"} | metrics <= set(ev["before_ts"])
        assert ev["before_ts"]["oece"] + ev["before_ts"]["uece"] == pytest.approx(
            ev["before_ts"]["ece"]
        )
        with np.load(folder / "predictions.npz", allow_pickle=False) as npz:
            assert npz["logits"].shape == (359, 10) and npz["labels"].shape == (359,)
            assert float(npz["temperature"]) == ev["temperature"]
            probs = torch.softmax(torch.from_numpy(npz["logits"]).double(), 1)
            top1 = (probs.argmax(1) == torch.from_numpy(npz["labels"])).double().mean()
            assert ev["before_ts"]["top1"] == pytest.approx(100 * top1.item())
    assert json.loads((evals["a+b"] / "metrics.json").read_text())["ensemble"]["members"] == [
        "a",
        "b",
    ]
    # the ensemble = mean softmax of the members
    p = [np.load(evals[r] / "predictions.npz")["logits"] for r in ("a", "b")]
    mean = (torch.softmax(torch.from_numpy(p[0]), 1) + torch.softmax(torch.from_numpy(p[1]), 1)) / 2
    ens = torch.softmax(torch.from_numpy(np.load(evals["a+b"] / "predictions.npz")["logits"]), 1)
    assert torch.allclose(ens, mean, atol=1e-5)
    rows = [line for line in report.read_text().splitlines() if line.startswith("| a")]
    assert len(rows) == 8  # a and a+b: before TS, after TS, more metrics, post-hoc
    assert "| a+b | ensemble | ensemble |" in report.read_text()


def test_rerun_only_reads_and_a_retrained_run_is_redone(
    evaluated, tmp_path, read_only, monkeypatch
):
    root = _copy(evaluated, tmp_path)
    folder = root / "eval" / "train" / "over"
    first = eval_files(folder)
    before = snapshot(root)
    # new time stamps on the run, same bytes: its digest is the same, nothing is redone
    for p in (root / "train" / "over").iterdir():
        p.touch()
    evaluate(root, "run=over")
    evaluate(root, "run=over", "batch_size=7")  # how logits are batched is not identity
    after = snapshot(root)
    assert {k: v for k, v in after.items() if not k.startswith("train/")} == {
        k: v for k, v in before.items() if not k.startswith("train/")
    }
    read_only(root)
    evaluate(root, "run=over")  # so it also reruns on read-only media
    monkeypatch.undo()
    # "retrain" the run: other weights, so another digest; the stale evaluation is replaced
    torch.manual_seed(1)
    model = build_classifier("digits-cnn", 4, 3)
    save_run(root / "train" / "over", model, [f"c{k}" for k in range(4)])
    evaluate(root, "run=over")
    second = eval_files(folder)
    assert second["predictions.npz"] != first["predictions.npz"]
    old_up = json.loads(first["manifest.json"])["upstream"]["train/over"]
    assert read_manifest(folder).upstream["train/over"] != old_up
    # another temperature criterion is another evaluation too
    evaluate(root, "run=over", "ts_criterion=ece")
    ev = json.loads((folder / "metrics.json").read_text())["evaluation"]
    assert ev["ts_criterion"] == "ece" and read_manifest(folder).info["settings"] == {
        "ts_criterion": "ece",
        "predictions_format": evals.PREDICTIONS_FORMAT,
    }
    assert sorted(p.name for p in (root / "eval" / "train").iterdir()) == ["over"]  # no leftovers


def test_a_failed_evaluation_never_replaces_or_half_writes(evaluated, tmp_path, monkeypatch):
    import stages.evaluate.stage

    root = _copy(evaluated, tmp_path)
    folder = root / "eval" / "train" / "over"
    complete = snapshot(root / "eval")
    torch.manual_seed(1)
    save_run(
        root / "train" / "over", build_classifier("digits-cnn", 4, 3), ["c0", "c1", "c2", "c3"]
    )

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stages.evaluate.stage, "reliability_diagram", full_disk)
    with pytest.raises(OSError, match="No space"):
        evaluate(root, "run=over")
    assert snapshot(root / "eval") == complete  # the old, complete evaluation is still there
    monkeypatch.undo()
    # a kill mid-build leaves a hidden work folder (and maybe a stepped-aside old one)
    for leftover in (".over.tmp", ".over.old"):
        (folder.parent / leftover).mkdir()
        (folder.parent / leftover / "metrics.json").write_text("{}")
    (root / "eval" / "train" / "half").mkdir()  # an evaluation without a manifest
    (root / "eval" / "train" / "half" / "metrics.json").write_text('{"evaluation": {}}')
    evaluate(root, "run=over")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["half", "over"]
    assert (
        read_manifest(folder).info["files"]["predictions.npz"]["sha256"]
        != json.loads(complete["train/over/manifest.json"][1])["info"]["files"]["predictions.npz"][
            "sha256"
        ]
    )
    report = (root / "eval" / "report.md").read_text()
    assert "| over |" in report and "half" not in report  # incomplete: not reported


def test_same_inputs_give_the_same_bytes_anywhere(evaluated, tmp_path):
    a = evaluated  # evaluated in a folder of its own
    b = constructed_root(tmp_path / "b")
    evaluate(b, "run=over")
    assert snapshot(a / "eval").keys() == snapshot(b / "eval").keys()
    assert eval_files(a / "eval" / "train" / "over") == eval_files(b / "eval" / "train" / "over")
    assert (a / "eval" / "report.md").read_bytes() == (b / "eval" / "report.md").read_bytes()


def test_streamed_splits_give_the_same_evaluation_as_decoded_ones(tmp_path, caplog):
    """Two runs + their ensemble + an OOD set, evaluated with test/val/OOD decoded into memory
    and streamed from the shards (auto, chosen by a budget below their decoded size): the same
    bytes in every eval folder and in the report."""
    roots = {}
    for path, sets in (("memory", ["data_path=memory"]),
                       ("stream", ["memory_budget_gb=0.00001", "stream_workers=2"])):  # fmt: skip
        root = constructed_root(tmp_path / path)
        torch.manual_seed(1)
        save_run(
            root / "train" / "other", build_classifier("digits-cnn", 4, 3), ["c0", "c1", "c2", "c3"]
        )
        rng = np.random.default_rng(1)
        ood = tmp_path / path / "ood" / "real" / "test"
        write_split(ood, rng.integers(0, 40, (50, 16, 16, 3), dtype=np.uint8), np.zeros(50), ["x"])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="semix"):
            evaluate(root, "runs=over,other", "batch_size=64", f"ood={ood}", *sets)
        chosen = [r.getMessage() for r in caplog.records if "data path" in r.getMessage()]
        assert len(chosen) == 1 and chosen[0].startswith(f"evaluate: data path {path}:"), chosen
        roots[path] = root
    memory, stream = (snapshot(roots[p] / "eval") for p in ("memory", "stream"))
    assert sorted(memory) == sorted(stream) and len(memory) == 3 * 4 + 1  # 3 folders + report
    assert {k: v[1] for k, v in memory.items()} == {k: v[1] for k, v in stream.items()}


def test_an_unfinished_run_is_not_evaluated(tmp_path, capsys):
    root = constructed_root(tmp_path)
    run = root / "train" / "over"
    (run / "manifest.json").unlink()  # killed before its manifest: not complete
    base = ["evaluate", "--preset", "digits", "--set", f"out={root.parent}", f"name={root.name}"]
    assert main([*base, "run=over"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not complete" in err and str(run) in err
    assert not (root / "eval").exists()
    with pytest.raises(ValueError, match="no trained runs"):
        evaluate(root)  # the unfinished run is not "every trained run"


def test_bad_input_gives_one_line_errors(tmp_path, capsys):
    root = constructed_root(tmp_path)
    base = ["evaluate", "--preset", "digits", "--set", f"out={root.parent}", f"name={root.name}"]
    assert main([*base, "run=a/b"]) == 2
    assert "plain folder name" in capsys.readouterr().err
    assert main([*base, "runs=over,over2", "ensemble_name=../x"]) == 2
    assert "plain folder name" in capsys.readouterr().err
    assert main([*base, "run=nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no trained weights" in err[0]
    assert main([*base, "run=over", f"ood={tmp_path / 'nothing'}"]) == 1
    assert "no prepared split" in capsys.readouterr().err


def test_report_groups_seeds_into_mean_and_std():
    from stages.evaluate.report import seed_summary

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
    shutil.copytree(root / "train" / "over", root / "finetune" / "over")  # same name, other stage
    evaluate(root)
    done = {f"{p.parent.name}/{p.name}" for p in (root / "eval").glob("*/*") if p.is_dir()}
    assert done == {"train/over", "train/second", "finetune/over-maccal", "finetune/over"}
    for folder in done:
        ev = json.loads((root / "eval" / folder / "metrics.json").read_text())["evaluation"]
        assert ev["stage"] == folder.split("/")[0]
    assert not (root / "eval" / "ensemble").exists()  # one by one, not as an ensemble
    report = (root / "eval" / "report.md").read_text()
    assert all(f"| {n} |" in report for n in ("over", "second", "over-maccal"))
    assert "| over | finetune |" in report and "| over | train |" in report
    empty = tmp_path / "runs" / "empty"
    shutil.copytree(root / "real", empty / "real")
    with pytest.raises(ValueError, match="no trained runs"):
        evaluate(empty)


def test_internal_runs_are_left_out_unless_asked(tmp_path, capsys):
    """The runs the stages used as tools (annotate's classifier encoder and fidelity judge,
    fit-generator's judge, as their config.json files name them; the study's tune-* runs) are
    neither evaluated by a bare evaluate nor listed in report.md; internal_runs=1 does both.
    A name alone makes no run internal: with a CLIP encoder, a run called `encoder` is a user's."""
    from stages.evaluate.report import internal_runs

    root = constructed_root(tmp_path)
    for name in ("encoder", "judge", "tune-csm-w1-s4", "judge2"):
        shutil.copytree(root / "train" / "over", root / "train" / name)
    atomic_write_json(
        root / "mixed" / "config.json",
        {"encoder": "classifier", "encoder_run": "encoder", "fidelity_run": "judge"},
    )
    atomic_write_json(root / "generator" / "config.json", {"judge_run": "judge2"})
    assert internal_runs(root) == {"encoder", "judge", "judge2"}
    evaluate(root)
    done = sorted(p.name for p in (root / "eval" / "train").iterdir())
    assert done == ["over"]
    report = (root / "eval" / "report.md").read_text()
    rows = {line.split(" | ")[0] for line in report.splitlines() if line.startswith("| ")}
    assert rows == {"| run", "| over"}  # header and the one user run, before and after TS
    assert "Left out" not in report  # no internal run was evaluated
    evaluate(root, "internal_runs=1")
    done = sorted(p.name for p in (root / "eval" / "train").iterdir())
    assert done == ["encoder", "judge", "judge2", "over", "tune-csm-w1-s4"]
    report = (root / "eval" / "report.md").read_text()
    assert all(f"| {n} | train |" in report for n in done) and "Left out" not in report
    evaluate(root, "run=over")  # the report follows the option of the call that wrote it
    report = (root / "eval" / "report.md").read_text()
    assert "| encoder | train |" not in report and "| over | train |" in report
    assert "Left out: the internal run(s) encoder, judge, judge2, tune-csm-w1-s4" in report
    # with a CLIP encoder the chain trained no classifier: `encoder` is a user's run
    atomic_write_json(
        root / "mixed" / "config.json",
        {"encoder": "openclip", "encoder_run": "encoder", "fidelity_run": ""},
    )
    assert internal_runs(root) == {"judge2"}
    # only internal runs: one line saying so and how to include them
    only = tmp_path / "runs" / "only"
    shutil.copytree(root / "real", only / "real")
    shutil.copytree(root / "train" / "tune-csm-w1-s4", only / "train" / "tune-csm-w1-s4")
    argv = ["evaluate", "--preset", "digits", "--set", f"out={only.parent}", f"name={only.name}"]
    capsys.readouterr()  # the evaluations above logged to stderr too
    assert main(argv) == 1
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if not line[:2].isdigit()]  # log lines start with a time
    assert len(errors) == 1 and "internal run(s) tune-csm-w1-s4" in errors[0]
    assert "internal_runs=1" in errors[0] and not (only / "eval").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_evaluation_matches_cpu(tmp_path):
    """The same run on the GPU: identical predictions up to float rounding, same accuracy."""
    cpu, gpu = constructed_root(tmp_path / "cpu"), constructed_root(tmp_path / "gpu")
    evaluate(cpu, "run=over", "device=cpu")
    evaluate(gpu, "run=over", "device=cuda")
    logits = [
        np.load(r / "eval" / "train" / "over" / "predictions.npz")["logits"] for r in (cpu, gpu)
    ]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-3, atol=1e-3)
    ev = [
        json.loads((r / "eval" / "train" / "over" / "metrics.json").read_text())["evaluation"]
        for r in (cpu, gpu)
    ]
    assert ev[0]["before_ts"]["top1"] == ev[1]["before_ts"]["top1"]
    assert ev[0]["before_ts"]["ece"] == pytest.approx(ev[1]["before_ts"]["ece"], abs=0.05)
