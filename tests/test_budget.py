"""One labelled budget: finetune reads its source run's images, every run records the labelled
images behind it, the study refuses unequal budgets, and the guidance chooser sits inside the
budget."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from core.io import atomic_write_json
from pipeline.registry import run_stage
from pipeline.study.config import StudyError, check_budget
from pipeline.study.records import recorded_budget
from shards.manifest import Manifest, write_manifest
from stages.common.budget import labelled_images, train_run_images
from stages.common.fidelity import FidelityCheck, Judge, make_judges

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 300


@pytest.fixture(scope="module")
def root(digits_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("budget")
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    return out / "digits"


def n_train(root: Path) -> int:
    return json.loads((root / "real" / "train" / "manifest.json").read_text())["num_samples"]


def test_finetune_reads_only_the_source_runs_images(root, caplog):
    out = [f"out={root.parent}"]
    run_stage("train", "digits", [*out, "run=small", "loss=ce", "epochs=1", f"train_limit={LIMIT}"])
    with caplog.at_level(logging.INFO, logger="semix"):
        run_stage("finetune", "digits", [*out, "run=small", "method=maccal", "maccal_epochs=1"])
    line = next(r.getMessage() for r in caplog.records if "train / " in r.getMessage())
    assert f"{LIMIT} train / " in line, line  # not real/train's 1,000+ images
    for folder, section in ((root / "train" / "small", "train"), (root / "finetune" / "small-maccal", "finetune")):  # fmt: skip
        metrics = json.loads((folder / "metrics.json").read_text())[section]
        assert metrics["labelled_train_images"] == LIMIT
    assert labelled_images(root, "finetune", "small-maccal") == LIMIT
    assert n_train(root) > LIMIT


# ---------------------------------------------------------------- the rule, on recorded folders


def complete(folder: Path, config: dict, kind: str = "run", upstream: dict | None = None) -> None:
    """A folder as a stage leaves it, reduced to what the budget reads (its config.json read
    back as the stage's typed config: a train run records its `run`, an sd series its model)."""
    atomic_write_json(folder / "config.json", config)
    write_manifest(folder, Manifest(kind, ("a", "b"), (), upstream or {}))


@pytest.fixture
def chain(root, tmp_path) -> Path:
    """A csm chain whose parts read different prefixes of real/train."""
    r = tmp_path / "digits"
    shutil.copytree(root / "real", r / "real")
    complete(r / "train" / "judge", {"run": "judge", "train_limit": 0, "loss": "ce"})
    complete(r / "train" / "encoder", {"run": "encoder", "train_limit": 200, "loss": "ce"})
    complete(r / "generator", {"train_limit": 100, "judge_run": "encoder"}, "generator")
    complete(r / "series", {"backend": "unet", "model": ""}, "series")
    complete(r / "mixed", {"encoder": "classifier", "encoder_run": "encoder", "train_limit": 150}, "mixed")  # fmt: skip
    complete(
        r / "train" / "csm",
        {"run": "csm", "train_limit": 100, "loss": "csm"},
        upstream={"mixed": "x"},
    )
    complete(r / "train" / "ce", {"run": "ce", "train_limit": 100, "loss": "ce"})
    return r


def test_a_run_counts_the_largest_prefix_behind_it(chain):
    assert labelled_images(chain, "train", "ce") == 100
    assert labelled_images(chain, "generator") == 200  # its guidance chooser saw 200
    assert labelled_images(chain, "mixed") == 200
    assert labelled_images(chain, "train", "csm") == 200
    assert train_run_images(chain, 100, chain / "mixed") == 200
    assert train_run_images(chain, 100) == 100


def test_a_54k_judge_choosing_the_guidance_enters_the_budget(chain):
    complete(chain / "generator", {"train_limit": 100, "judge_run": "judge"}, "generator")
    assert labelled_images(chain, "train", "csm") == n_train(chain)


def test_a_part_that_does_not_record_what_it_read_makes_the_count_unknown(chain):
    (chain / "mixed" / "config.json").unlink()  # e.g. a mixed set pulled from the Hub
    assert labelled_images(chain, "train", "csm") is None
    assert train_run_images(chain, 100, chain / "mixed") is None
    assert labelled_images(chain, "train", "ce") == 100
    with pytest.raises(StudyError, match="budget of csm is unknown"):
        check_budget([{"method": "ce", "labelled_train_images": 100},
                      {"method": "csm", "labelled_train_images": None}])  # fmt: skip


def test_generates_endpoint_judge_counts_only_when_it_chooses(chain):
    """csm-redraw's series: the judge that chose which series to redraw shapes the set; a
    judge recorded without its check (endpoint_check off: none is) chooses nothing."""
    redraw = {"backend": "unet", "model": "", "endpoint_check": "redraw", "endpoint_judge": "judge"}
    complete(chain / "series", redraw, "series")
    assert labelled_images(chain, "train", "csm") == n_train(chain)  # the 54k-style judge
    complete(chain / "series", {**redraw, "endpoint_judge": "ce"}, "series")
    assert labelled_images(chain, "series") == 200  # ce's 100 < the generator's chooser's 200
    complete(chain / "series", {**redraw, "endpoint_check": "off"}, "series")
    assert labelled_images(chain, "train", "csm") == 200
    # a pretrained generator with a judge inside the budget: the judge alone counts
    complete(
        chain / "series",
        {**redraw, "backend": "sd", "model": "/m", "endpoint_judge": "ce"},
        "series",
    )
    assert labelled_images(chain, "series") == 100


def test_a_study_record_states_train_and_val_images(chain):
    from stages.common.budget import labelled_split_images, val_size

    n_val = json.loads((chain / "real" / "val" / "manifest.json").read_text())["num_samples"]
    assert val_size(chain) == n_val > 0
    assert labelled_split_images(chain, 200) == {"train": 200, "val": n_val}
    assert labelled_split_images(chain, None) is None


def test_a_pretrained_part_adds_nothing_to_the_count(chain):
    complete(chain / "series", {"backend": "sd", "model": "some/model"}, "series")
    complete(chain / "mixed", {"encoder": "openclip", "train_limit": 50}, "mixed")
    assert labelled_images(chain, "mixed") == 50  # the prototypes' images only


def test_the_study_refuses_unequal_budgets_in_one_line():
    records = [
        {"method": "ce", "labelled_train_images": 5000},
        {"method": "ce+maccal", "labelled_train_images": 54000},
        {"method": "csm", "labelled_train_images": 5000},
    ]
    with pytest.raises(StudyError) as e:
        check_budget(records)
    msg = str(e.value)
    assert "\n" not in msg
    assert "5000 images: ce, csm" in msg and "54000 images: ce+maccal" in msg
    assert check_budget(records[::2]) == 5000


# ---------------------------------------------------------------- the guidance chooser


def test_without_a_cnn_the_probe_chooses_on_the_budgets_images(root, tmp_path):
    judges = make_judges(root, "", "cpu", train_limit=LIMIT)
    assert [j.name for j in judges] == ["linear probe"]
    assert judges[0].labelled_train_images == LIMIT
    assert make_judges(root, "", "cpu")[0].labelled_train_images == n_train(root)


def test_the_first_judge_chooses_and_the_others_only_report(tmp_path):
    chooser = Judge("cnn:encoder", lambda x: x, 80.0, 100)
    reporter = Judge("cnn:judge", lambda x: x, 90.0, 1000)
    check = FidelityCheck([chooser, reporter], (1.0, 2.0), ("a", "b"), seed=0, per_class=1)

    def stats(acc: float) -> dict:
        return {"accuracy": acc, "per_class": {}}

    # the reporter prefers w = 2, the chooser w = 1: w = 1 it is
    curve = [{"step": 1, "guidance": {
        "1": {"cnn:encoder": stats(70.0), "cnn:judge": stats(50.0)},
        "2": {"cnn:encoder": stats(60.0), "cnn:judge": stats(95.0)},
    }}]  # fmt: skip
    w, clip, summary = check.choose(curve)
    assert w == 1.0 and clip is None and summary == {"cnn:encoder": 70.0, "cnn:judge": 50.0}
    torch.manual_seed(0)
    check.write(tmp_path, curve, w)
    judges = json.loads((tmp_path / "fidelity.json").read_text())["judges"]
    assert judges["cnn:encoder"]["role"] == "chooses w"
    assert judges["cnn:judge"] == {
        "real_test_accuracy": 90.0, "labelled_train_images": 1000, "role": "reports only"
    }  # fmt: skip


def test_the_study_reads_the_budget_a_run_recorded_and_none_from_an_older_run(tmp_path):
    for stage, budget in (("train", 5000), ("finetune", None)):
        run = tmp_path / stage / "r"
        section = {"finished": True} | ({"labelled_train_images": budget} if budget else {})
        atomic_write_json(run / "metrics.json", {stage: section})
        assert recorded_budget(run) == budget  # a fine-tuning before the fix read all of train
