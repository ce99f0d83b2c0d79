"""finetune stage: MaC-Cal and FeDLaS on a tiny trained digits run, evaluate on the result, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import kill_when, snapshot, subprocess_env
from safetensors.torch import load_file
from torch import nn

from models.classifiers import CLASSIFIERS, Classifier, build_classifier
from models.finetuning import GateTracker, arch_with_head, build_model
from models.heads import MaskedBottleneckHead
from models.training import collect_logits
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.manifest import ShardError, manifest_digest, read_manifest
from shards.reader import load_split
from shards.runs import load_weights, save_weights

SRC = "src"  # the Stage-I run every test fine-tunes


# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("finetune")]


@pytest.fixture(scope="module")
def root(digits_root, tmp_path_factory) -> Path:
    """runs/digits/ with real/ and train/src/ (2 epochs of CE with the train stage) on the first
    640 images of real/train, about half: a fine-tuning reads only its source run's images
    (tests/test_budget.py), so every fine-tuning of this module does half the work."""
    out = tmp_path_factory.mktemp("finetune")
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    sets = [f"out={out}", f"run={SRC}", "loss=ce", "epochs=2", "train_limit=640"]
    run_stage("train", "digits", sets)
    return out / "digits"


def finetune(root: Path, *sets: str) -> Path:
    return run_stage("finetune", "digits", [f"out={root.parent}", f"run={SRC}", *sets])


def evaluate(root: Path, run: str) -> dict:
    run_stage("evaluate", "digits", [f"out={root.parent}", f"run={run}"])
    return json.loads((root / "eval" / "finetune" / run / "metrics.json").read_text())["evaluation"]


# ---------------------------------------------------------------- MaC-Cal


@pytest.fixture(scope="module")
def maccal(root) -> Path:
    """Three MaC-Cal epochs with the digits augmentation (the backbone runs on every batch)."""
    return finetune(root, "objective=maccal", "maccal_epochs=3")


def test_maccal_writes_a_run_folder_with_q_trace(root, maccal):
    assert maccal == root / "finetune" / f"{SRC}-maccal"
    for name in ("config.json", "model.safetensors", "model.json", "q_trace.png", "curves.png"):
        assert (maccal / name).is_file(), name
    meta = json.loads((maccal / "model.json").read_text())
    assert meta["arch"]["head"] == {"type": "masked-bottleneck", "r": 256}
    assert meta["loss"] == "ce+maccal" and meta["source"]["run"] == SRC
    section = json.loads((maccal / "metrics.json").read_text())["finetune"]
    assert section["finished"] and len(section["history"]) == 3
    trace = json.loads((maccal / "q_trace.json").read_text())
    cfg, hist = trace["config"], trace["history"]
    assert [h["epoch"] for h in hist] == [1, 2, 3] and cfg["total_epochs"] == 3
    assert [h["epoch"] for h in section["history"]] == [1, 2, 3]  # one numbering everywhere
    assert hist[0]["q"] == cfg["q0"] == 0.9
    for h, nxt, logged in zip(hist, [*hist[1:], {"q": trace["q"]}], section["history"]):
        assert cfg["q_min"] <= h["q"] <= cfg["q_max"] and 0 <= h["acc"] <= 1
        assert abs(h["delta"]) <= h["tau"] + 1e-12  # the step is clipped by τ_t
        assert nxt["q"] == pytest.approx(min(max(h["q"] + h["delta"], 0.3), 1.0))
        assert logged["q"] == h["q"] and logged["train_conf"] == pytest.approx(100 * h["conf"])
    # Dropped weights of the last epoch's masks are zero in the saved head (inference uses M ⊙ W).
    state = load_file(str(maccal / "model.safetensors"))
    assert not bool(state["head.fc1.weight"][~state["head.mask1"]].any())


def test_maccal_leaves_the_backbone_bitwise_unchanged(root, maccal):
    before, _ = load_weights(root / "train" / SRC)
    after, _ = load_weights(maccal)
    backbone = [k for k in before if not k.startswith("head.")]
    assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)  # BN buffers too
    assert {k for k in after if k.startswith("head.")} == {
        f"head.{p}" for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "mask1", "mask2")
    }


def test_maccal_is_a_complete_run_that_a_rerun_only_reads(root, maccal):
    manifest = read_manifest(maccal)
    assert manifest.kind == "run" and manifest.upstream == {
        "real/train": manifest_digest(root / "real" / "train"),
        "real/val": manifest_digest(root / "real" / "val"),
        "init": manifest_digest(root / "train" / SRC),
    }
    assert {"q_trace.json", "q_trace.png", "curves.png"} <= set(manifest.info["files"])
    before = snapshot(maccal)
    assert finetune(root, "objective=maccal", "maccal_epochs=3") == maccal
    assert snapshot(maccal) == before
    with pytest.raises(ShardError, match="different config"):
        finetune(root, "objective=maccal", "maccal_epochs=4")


def test_maccal_is_reproducible_and_its_inference_deterministic(root):
    """Without augmentation the features are computed once; two runs give the same bytes."""
    if not (root / "train" / "twin").is_dir():  # a second name for src: its own output folder
        shutil.copytree(root / "train" / SRC, root / "train" / "twin")
    sets = ("run=twin", "objective=maccal", "maccal_epochs=2", "crop_pad=0", "flip=false")
    folder = finetune(root, *sets)
    first = (folder / "model.safetensors").read_bytes()
    shutil.rmtree(folder)
    assert (finetune(root, *sets) / "model.safetensors").read_bytes() == first
    val = load_split(root / "real" / "val").images
    logits = []
    for _ in range(2):  # two independent rebuilds from model.json, as evaluate would do them
        state, meta = load_weights(folder)
        model = build_model(meta["arch"])
        model.load_state_dict(state)
        norm = meta["normalize"]
        logits.append(collect_logits(model, val, norm["mean"], norm["std"], batch_size=64))
        logits.append(collect_logits(model, val, norm["mean"], norm["std"], batch_size=17))
    # the same model and batch size: the same bytes; another batch size may take other CPU
    # kernels (oneDNN blocks fp32 convolutions by batch on AVX512/AMX CPUs): equal to float noise
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[3])
    assert torch.allclose(logits[0], logits[1], rtol=0, atol=1e-5)
    shutil.rmtree(folder)


@pytest.mark.parametrize(
    "sets",
    [("objective=maccal", "maccal_epochs=2", "crop_pad=0", "flip=false"),  # features once
     ("objective=fedlas-ls", "fedlas_epochs=1")],  # the whole model on every batch
)  # fmt: skip
def test_streamed_finetuning_equals_decoded(root, sets):
    """The same fine-tuning with real/train and real/val decoded into memory and streamed from
    the shards (a budget below their decoded size): the same weights, bit for bit."""
    weights, paths = [], []
    for name, path in (("mem", ["data_path=memory"]), ("str", ["memory_budget_gb=0.00001"])):
        if not (root / "train" / name).is_dir():  # src under another name: its own output
            shutil.copytree(root / "train" / SRC, root / "train" / name)
        folder = finetune(root, *sets, *path, f"run={name}")
        weights.append((folder / "model.safetensors").read_bytes())
        paths.append(json.loads((folder / "host.json").read_text())["data_path"]["path"])
        shutil.rmtree(folder)
    assert paths == ["memory", "stream"] and weights[0] == weights[1]


def test_evaluate_reads_a_maccal_run(root, maccal):
    """evaluate rebuilds the bottleneck head from model.json (models.finetuning.build_model)."""
    ev = evaluate(root, f"{SRC}-maccal")
    assert ev["stage"] == "finetune" and ev["loss"] == "ce+maccal"
    assert 0 <= ev["before_ts"]["ece"] <= 100 and ev["before_ts"]["top1"] > 30
    assert f"| {SRC}-maccal | finetune | ce+maccal |" in (root / "eval" / "report.md").read_text()


# ---------------------------------------------------------------- FeDLaS


@pytest.mark.parametrize("objective", ["fedlas-ls", "fedlas-mbls"])
def test_fedlas_finetuning_logs_the_gate_and_evaluates(root, objective):
    folder = finetune(root, f"objective={objective}", "fedlas_epochs=2")
    meta = json.loads((folder / "model.json").read_text())
    source_meta = json.loads((root / "train" / SRC / "model.json").read_text())
    assert meta["arch"] == source_meta["arch"] and meta["loss"] == f"ce+{objective}"
    hist = json.loads((folder / "metrics.json").read_text())["finetune"]["history"]
    assert len(hist) == 2 and (folder / "gate.png").is_file()
    for h in hist:
        assert set(h["mode_share"]) == {"+1", "-1", "0"}
        assert sum(h["mode_share"].values()) == pytest.approx(1.0)
        assert 0 < h["r_mean"] < 2 * (0.05 if objective == "fedlas-ls" else 0.1)
    assert hist[0]["flip_rate"] is None and 0.0 <= hist[1]["flip_rate"] <= 1.0
    before, after = load_weights(root / "train" / SRC)[0], load_weights(folder)[0]
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the whole model moved
    ev = evaluate(root, folder.name)
    assert ev["stage"] == "finetune" and ev["loss"] == f"ce+{objective}"


def test_gate_tracker_shares_and_flip_rate():
    tracker = GateTracker(4)
    tracker.update(torch.tensor([0, 1]), torch.tensor([1.0, -1.0]))
    tracker.update(torch.tensor([2]), torch.tensor([0.0]))
    first = tracker.end_epoch()  # sample 3 unseen
    assert first["flip_rate"] is None
    assert first["mode_share"] == pytest.approx({"+1": 1 / 3, "-1": 1 / 3, "0": 1 / 3})
    tracker.update(torch.tensor([3, 1, 0]), torch.tensor([1.0, 1.0, 1.0]))
    second = tracker.end_epoch()  # seen in both: 0 (same), 1 (flipped)
    assert second["flip_rate"] == pytest.approx(0.5)
    assert second["mode_share"] == pytest.approx({"+1": 1.0, "-1": 0.0, "0": 0.0})


# ---------------------------------------------------------------- processes, kill + rerun


def _cli(root: Path, *sets: str) -> list[str]:
    cmd = ["-m", "pipeline", "finetune", "--preset", "digits", "--set", f"out={root.parent}"]
    return [sys.executable, *cmd, f"run={SRC}", *sets]


def _finetune_here(capsys, root: Path, *sets: str) -> str:
    """`python -m pipeline finetune ...` (_cli) run in this process: the same argv through
    pipeline.cli.main, which is all pipeline/__main__.py runs, at the one torch thread of this
    module (one_thread) that the subprocesses get from OMP_NUM_THREADS=1. Its stderr, for the
    lines the tests read; a process start saved where the test is not about processes."""
    capsys.readouterr()  # only this run's lines
    rc = main(_cli(root, *sets)[3:])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    return err


def _copy(root: Path, to: Path) -> Path:
    """real/ and the trained run under another root: a finetune folder name per root."""
    shutil.copytree(root / "real", to / "digits" / "real")
    shutil.copytree(root / "train" / SRC, to / "digits" / "train" / SRC)
    return to / "digits"


def _history(folder: Path) -> list[dict]:
    history = json.loads((folder / "metrics.json").read_text())["finetune"]["history"]
    return [{k: v for k, v in h.items() if k not in ("seconds", "images_per_s")} for h in history]


@pytest.mark.parametrize(
    "sets", [("objective=maccal", "maccal_epochs=4"), ("objective=fedlas-ls", "fedlas_epochs=4")]
)
def test_killed_finetune_resumes_to_identical_weights(root, tmp_path, sets, capsys):
    """SIGKILL once the second checkpoint is complete, rerun: the same bytes and history as an
    uninterrupted run (MaC-Cal: masks, q and MaskedSGD's momentum; FeDLaS: the gate, the NCI
    statistics and the previous epoch's ψ for the flip rate all come back). The killed run is
    a real process; the uninterrupted run and the rerun are in-process (_finetune_here)."""
    whole, killed = _copy(root, tmp_path / "whole"), _copy(root, tmp_path / "killed")
    _finetune_here(capsys, whole, *sets)
    out = killed / "finetune" / f"{SRC}-{sets[0].removeprefix('objective=')}"
    kill_when(_cli(killed, *sets), (out / "checkpoints" / "checkpoint_2").is_dir)
    assert not (out / "manifest.json").exists(), "finished before it could be killed"
    err = _finetune_here(capsys, killed, *sets)
    assert "resumed from" in err, err[-2000:]
    ref = whole / "finetune" / out.name
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert _history(out) == _history(ref) and len(_history(out)) == 4


def test_maccal_on_two_processes_equals_one(root, tmp_path, capsys):
    """MaC-Cal's backbone is frozen in eval mode and its head has no BatchNorm, so nothing in
    a step depends on the number of processes but the order of float sums: 2 ranks (torchrun,
    gloo) end within float32 rounding of 1 rank, q trajectory included (fp32: bf16's rounding
    of the per-rank sums would hide what is compared). The 1 rank is in-process
    (_finetune_here)."""
    one, two = _copy(root, tmp_path / "one"), _copy(root, tmp_path / "two")
    sets = ("objective=maccal", "maccal_epochs=3", "precision=fp32")
    _finetune_here(capsys, one, *sets)
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = _cli(two, *sets)
    proc = subprocess.run(
        [cmd[0], *torchrun, *cmd[1:]], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = (
        load_file(str(d / "finetune" / f"{SRC}-maccal" / "model.safetensors")) for d in (one, two)
    )
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
        else:  # the masks: the same Bernoulli draws from the same q
            assert torch.equal(a[k], b[k]), k
    ha, hb = (_history(d / "finetune" / f"{SRC}-maccal") for d in (one, two))
    for x, y in zip(ha, hb):
        assert y["q"] == pytest.approx(x["q"], abs=1e-6) and y["kept"] == x["kept"]
        assert y["train_acc"] == pytest.approx(x["train_acc"], abs=1e-9)


# ---------------------------------------------------------------- rebuilding and bad input


def test_build_model_round_trips_the_bottleneck_head():
    model = build_classifier("digits-cnn", 10, 1)
    model.head = MaskedBottleneckHead(model.feature_dim, 10, 8, generator=torch.Generator())
    model.head.draw_masks(0.5, torch.Generator().manual_seed(1))
    rebuilt = build_model(arch_with_head(model))
    rebuilt.load_state_dict(model.state_dict())  # strict: same keys and shapes
    x = torch.randn(3, 1, 16, 16)
    assert torch.equal(rebuilt.eval()(x), model.eval()(x))
    assert isinstance(build_model(model.arch_config()).head, nn.Linear)


class Headless(Classifier):
    """A classifier whose logits come from one opaque module: no forward_features, no head."""

    def __init__(self, arch: str, num_classes: int, in_channels: int) -> None:
        super().__init__(arch, num_classes, in_channels, feature_dim=4)
        self.head = nn.Identity()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 256, num_classes))


def _one_line_error(capsys, argv: list[str], code: int, match: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_bad_input_gives_one_line_errors(root, tmp_path, capsys, monkeypatch):
    base = ["finetune", "--preset", "digits", "--set", f"out={root.parent}"]
    _one_line_error(
        capsys, [*base, f"run={SRC}", "objective=nope"], 2, "objective='nope' is not valid"
    )
    _one_line_error(capsys, [*base, "objective=maccal"], 2, "set run=NAME")  # finetune needs a run
    _one_line_error(capsys, [*base, f"run={SRC}", "maccal.q0=0.1"], 2, "maccal.q_min <= maccal.q0")
    _one_line_error(capsys, [*base, "run=ghost"], 1, "has no trained weights")
    assert not (root / "finetune" / "ghost-maccal").exists()
    # A model without a separable head (registered for this test only).
    monkeypatch.setitem(CLASSIFIERS, "headless", Headless)
    meta = json.loads((root / "train" / SRC / "model.json").read_text())
    arch = {"arch": "headless", "num_classes": 10, "in_channels": 1}
    save_weights(
        root / "train" / "headless", Headless("headless", 10, 1).state_dict(), meta | {"arch": arch}
    )
    _one_line_error(capsys, [*base, "run=headless"], 1, "has no separable head")
    # model.json naming a head type nobody knows.
    state, _ = load_weights(root / "train" / SRC)
    odd = meta | {"arch": meta["arch"] | {"head": {"type": "nope"}}}
    save_weights(root / "train" / "oddhead", state, odd)
    _one_line_error(
        capsys, [*base, "run=oddhead", "objective=fedlas-ls"], 1, "unknown head type 'nope'"
    )
    assert not any((root / "finetune").glob("headless-*")) and not any(
        (root / "finetune").glob("oddhead-*")
    )
