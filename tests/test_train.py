"""train stage: every loss path, checkpoints and best weights, 2 processes, kill + resume, bad input."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import subprocess_env
from safetensors.torch import load_file

from pipeline.cli import main, run_stage
from pipeline.configs.train import LOSS_FIELDS
from shards.datasets import load_series_table
from shards.reader import load_split
from shards.writer import ShardFolder

K = 4  # members per series in the test mixed/ folder
TINY = ["epochs=1", "train_limit=192", "batch_size=64"]


def write_mixed(folder: Path, real_train: Path, class_names=None, drop_member: bool = True) -> Path:
    """A small mixed/ folder: series = pixel blends of a real image of a and one of b.

    Pairs (c, c+1 mod 10) cover every class; one series per pair, plus one incomplete series.
    """
    split = load_split(real_train)
    names = list(class_names or split.class_names)
    first = {c: split.images[split.labels == c][:2].numpy() for c in range(len(split.class_names))}
    pairs = [(c, (c + 1) % 10) for c in range(10)] + [(0, 5)]
    samples = []
    for sid, (a, b) in enumerate(pairs):
        a, b = min(a, b), max(a, b)
        for k in range(K):
            if drop_member and sid == len(pairs) - 1 and k == 2:
                continue  # the incomplete series
            alpha = k / (K - 1)
            image = alpha * first[a][0].astype(float) + (1 - alpha) * first[b][1].astype(float)
            lam = alpha + 0.05 * np.sin(sid + k)
            t_a = float(1 / (1 + np.exp(-4.0 * (lam - 0.5))))
            meta = dict(
                series=sid,
                position=k,
                classes=[a, b],
                names=[names[a], names[b]],
                alpha=alpha,
                seed=sid,
                generator="blend",
                revision="",
                sampler="none",
                steps=0,
                guidance=0.0,
                lambda_hat=lam,
                soft=[t_a, 1 - t_a],
            )
            samples.append(
                {
                    "__key__": f"s{sid:07d}_{k:02d}",
                    "png": image.round().astype(np.uint8),
                    "cls": a if t_a >= 0.5 else b,
                    "json": meta,
                }
            )
    shards = ShardFolder(folder, "mixed")
    shards.write(0, samples[:20])
    shards.write(1, samples[20:])
    shards.finish(
        2, kind="mixed", class_names=names, info={"alphas": [k / (K - 1) for k in range(K)]}
    )
    return folder


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(digits_root, tmp_path_factory) -> Path:
    """runs/digits/ with real/ and a small mixed/; the runs of this module write next to them."""
    out = tmp_path_factory.mktemp("train")
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    write_mixed(out / "digits" / "mixed", out / "digits" / "real" / "train")
    return out / "digits"


def train(root: Path, *sets: str) -> Path:
    return run_stage("train", "digits", [f"out={root.parent}", *sets])


def test_series_table_keeps_complete_series_only(root):
    table = load_series_table(root / "mixed", [str(c) for c in range(10)])
    assert len(table) == 10 and table.dropped == 1 and table.members == K
    assert table.images.shape == (10, K, 16, 16, 3) and table.classes.shape == (10, 2)
    assert torch.allclose(table.alpha[0], torch.linspace(0, 1, K))
    assert bool((table.soft > 0).all() and (table.soft < 1).all())


@pytest.mark.parametrize("loss", list(LOSS_FIELDS))
def test_every_loss_trains_one_tiny_epoch(root, loss):
    run_dir = train(root, f"run=tiny-{loss}", f"loss={loss}", *TINY)
    meta = json.loads((run_dir / "model.json").read_text())
    assert meta["arch"]["arch"] == "digits-cnn" and meta["image_size"] == 16
    assert (
        meta["class_names"] == [str(c) for c in range(10)] and len(meta["normalize"]["mean"]) == 1
    )
    state = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.isfinite(v.float()).all() for v in state.values())
    section = json.loads((run_dir / "metrics.json").read_text())["train"]
    assert section["finished"] and len(section["history"]) == 1
    assert {"loss", "val_acc", "val_ece", "images_per_s"} <= set(section["history"][0])
    assert np.isfinite(section["history"][0]["loss"])
    assert (run_dir / "checkpoints" / "checkpoint_0" / "semix_state.json").is_file()


def test_final_weights_are_the_best_epoch_and_checkpoints_are_limited(root):
    run_dir = train(root, "run=best", "epochs=3", "train_limit=256", "checkpoint_limit=3", "lr=0.3")
    section = json.loads((run_dir / "metrics.json").read_text())["train"]
    accs = [h["val_acc"] for h in section["history"]]
    assert section["best_epoch"] == accs.index(max(accs))
    ckpt = load_file(
        str(run_dir / "checkpoints" / f"checkpoint_{section['best_epoch']}" / "model.safetensors")
    )
    final = load_file(str(run_dir / "model.safetensors"))
    assert final.keys() == {k.removeprefix("model.") for k in ckpt if k.startswith("model.")}
    assert all(torch.equal(final[k], ckpt["model." + k]) for k in final)
    assert not (run_dir / "best.safetensors").exists() and (run_dir / "curves.png").is_file()
    # a limit of 2 keeps the newest two
    run_dir = train(root, "run=limit", "epochs=3", "train_limit=128", "checkpoint_limit=2")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "checkpoint_1",
        "checkpoint_2",
    ]
    # a finished run is left alone; the same run name with another config is refused
    before = (run_dir / "model.safetensors").stat().st_mtime_ns
    train(root, "run=limit", "epochs=3", "train_limit=128", "checkpoint_limit=2")
    assert (run_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="different config"):
        train(root, "run=limit", "epochs=4", "train_limit=128", "checkpoint_limit=2")


def _cli(root: Path, extra: list[str]) -> list[str]:
    return ["-m", "pipeline", "train", "--preset", "digits", "--set", f"out={root.parent}", *extra]


def test_two_processes_train_and_checkpoint(root):
    """torchrun starts two ranks (gloo on CPU); accelerate wraps the model in DDP."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *_cli(root, ["run=ddp", "loss=csm", "epochs=2", "train_limit=256", "batch_size=64"]),
    ]
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = root / "train" / "ddp"
    assert "2 process(es)" in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "checkpoint_0",
        "checkpoint_1",
    ]
    assert len(json.loads((run_dir / "metrics.json").read_text())["train"]["history"]) == 2
    assert (run_dir / "model.safetensors").is_file()


def test_killed_run_resumes_to_identical_weights(root):
    args = ["loss=csm", "epochs=6", "train_limit=640", "batch_size=64"]
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    whole = subprocess.run(
        [sys.executable, *_cli(root, ["run=whole", *args])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    # the same run, SIGKILLed as soon as its first checkpoint is complete
    run_dir = root / "train" / "killed"
    proc = subprocess.Popen(
        [sys.executable, *_cli(root, ["run=killed", *args])],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "checkpoint_0" / "semix_state.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before exit"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "model.json").exists(), "the run finished before it could be killed"
    resumed = subprocess.run(
        [sys.executable, *_cli(root, ["run=killed", "resume=latest", *args])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a = load_file(str(root / "train" / "whole" / "model.safetensors"))
    b = load_file(str(run_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hist = [
        json.loads((root / "train" / r / "metrics.json").read_text())["train"]["history"]
        for r in ("whole", "killed")
    ]
    drop = ("seconds", "images_per_s")
    assert [{k: v for k, v in h.items() if k not in drop} for h in hist[0]] == [
        {k: v for k, v in h.items() if k not in drop} for h in hist[1]
    ]


def _one_line_error(capsys, argv: list[str], code: int, match: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_bad_input_gives_one_line_errors(root, tmp_path, capsys):
    base = ["train", "--preset", "digits", "--set", f"out={root.parent}", *TINY]
    _one_line_error(capsys, [*base, "run=x", "loss=nope"], 2, "loss='nope' is not valid")
    _one_line_error(
        capsys, [*base, "run=x", "model=resnet9000"], 2, "model='resnet9000' is not valid"
    )
    empty = ["train", "--preset", "digits", "--set", f"out={tmp_path}", "run=x"]
    _one_line_error(capsys, empty, 1, "does not exist")
    incomplete = shutil.copytree(root / "mixed", tmp_path / "incomplete")
    (incomplete / "manifest.json").unlink()
    _one_line_error(capsys, [*base, "run=inc", "loss=csm", f"mixed={incomplete}"], 1, "incomplete")
    other = write_mixed(
        tmp_path / "letters", root / "real" / "train", class_names=list("abcdefghij")
    )
    _one_line_error(
        capsys, [*base, "run=cls", "loss=csm", f"mixed={other}"], 1, "class lists must be identical"
    )
