"""train stacks: runs that differ only by seed, trained together in one process
(stages.train.run_stack, pipeline.registry.run_train_stack), each as it would be alone."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import kill_when, snapshot
from safetensors.torch import load_file

from core.config import ConfigError
from core.logs import setup_logging
from pipeline.cli import main
from pipeline.registry import resolve_stage_config, run_stage, run_train_stack
from shards.manifest import manifest_digest
from shards.runs import run_complete
from stages import train as train_stage

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["epochs=2", "train_limit=256", "batch_size=64"]
TIMING = ("seconds", "images_per_s")  # host-dependent entries of a history


@pytest.fixture(scope="module")
def roots(digits_root, tmp_path_factory) -> tuple[Path, Path]:
    """Two copies of runs/digits/ with real/: one for stacks, one for runs trained alone."""
    out = []
    for name in ("stacked", "alone"):
        root = tmp_path_factory.mktemp(name) / "digits"
        shutil.copytree(digits_root / "real", root / "real")
        out.append(root)
    return out[0], out[1]


def member_sets(root: Path, seed: int, *extra: str) -> list[str]:
    return [f"out={root.parent}", f"run=ce-s{seed}", f"seed={seed}", "loss=ce", *TINY, *extra]


def history(folder: Path) -> list[dict]:
    entries = json.loads((folder / "metrics.json").read_text())["train"]["history"]
    return [{k: v for k, v in h.items() if k not in TIMING} for h in entries]


def made_from(root: Path) -> dict[str, str]:
    return {f"real/{s}": manifest_digest(root / "real" / s) for s in ("train", "val")}


def test_a_stack_trains_each_seed_as_it_trains_alone(roots):
    stacked, alone = roots
    seeds = (1, 2, 3)
    folders = run_train_stack("digits", [member_sets(stacked, s) for s in seeds])
    assert folders == [stacked / "train" / f"ce-s{s}" for s in seeds]
    singles = [run_stage("train", "digits", member_sets(alone, s)) for s in seeds]
    weights = []
    for folder, single in zip(folders, singles, strict=True):
        # the same identity: config.json byte for byte, complete from the same inputs
        assert (folder / "config.json").read_bytes() == (single / "config.json").read_bytes()
        assert run_complete(folder, made_from(stacked))
        a, b = load_file(folder / "model.safetensors"), load_file(single / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
        assert_same_history(folder, single)
        weights.append(a)
    # each member its own init and data: the seeds' weights differ
    assert not torch.equal(weights[0]["head.weight"], weights[1]["head.weight"])


def assert_same_history(a: Path, b: Path) -> None:
    """metrics.json's histories equal to float tolerance, epoch by epoch, timings aside."""
    for x, y in zip(history(a), history(b), strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), (k, x[k], y[k])


def test_a_stacked_run_is_complete_for_plain_train_and_a_rerun_only_reads(roots):
    stacked, _ = roots
    seeds = (1, 2, 3)
    run_train_stack("digits", [member_sets(stacked, s) for s in seeds])  # made above, or now
    before = snapshot(stacked / "train")
    # plain train of one member, and the stack again: "already finished", nothing written
    assert run_stage("train", "digits", member_sets(stacked, 2)) == stacked / "train" / "ce-s2"
    run_train_stack("digits", [member_sets(stacked, s) for s in seeds])
    assert snapshot(stacked / "train") == before
    # one member missing: only it trains, the others only read
    shutil.rmtree(stacked / "train" / "ce-s3")
    run_train_stack("digits", [member_sets(stacked, s) for s in seeds])
    others = lambda files: {k: v for k, v in files.items() if not k.startswith("ce-s3")}  # noqa: E731
    assert others(snapshot(stacked / "train")) == others(before)
    assert run_complete(stacked / "train" / "ce-s3", made_from(stacked))


def test_a_stack_refuses_runs_that_differ_in_more_than_seed(roots):
    stacked, _ = roots
    cfgs = [
        resolve_stage_config("train", "digits", member_sets(stacked, 1)),
        resolve_stage_config("train", "digits", member_sets(stacked, 2, "lr=0.01")),
    ]
    with pytest.raises(ConfigError, match="differs from ce-s1 in lr"):
        train_stage.check_stack(cfgs)
    same_name = [cfgs[0], resolve_stage_config("train", "digits", member_sets(stacked, 1))]
    with pytest.raises(ConfigError, match="run names repeat"):
        train_stage.check_stack(same_name)


STACK_SCRIPT = """
import sys
from core.logs import setup_logging
from pipeline.registry import run_train_stack
setup_logging()
out, *rest = sys.argv[1:]
run_train_stack("digits", [[f"out={out}", f"run=k-s{s}", f"seed={s}", *rest] for s in (4, 5)])
"""


def _stack(out: Path, *sets: str) -> list[str]:
    return [sys.executable, "-c", STACK_SCRIPT, str(out), *sets]


def _stack_here(capsys, out: Path, *sets: str) -> str:
    """STACK_SCRIPT's calls in this process (setup_logging, then run_train_stack with the same
    members), at the one torch thread of this module (one_thread) that the script's process
    gets from OMP_NUM_THREADS=1. Its stderr, for the lines the test reads."""
    capsys.readouterr()  # only this stack's lines
    setup_logging()
    run_train_stack("digits", [[f"out={out}", f"run=k-s{s}", f"seed={s}", *sets] for s in (4, 5)])
    return capsys.readouterr().err


def test_a_killed_stack_resumes_to_the_bytes_of_one_not_killed(digits_root, tmp_path, capsys):
    """The stack SIGKILLed mid-way is a real process; the stack never killed and the rerun
    are in-process (_stack_here)."""
    args = ["loss=ce", "epochs=4", "train_limit=512", "batch_size=64"]
    outs = {}
    for name in ("whole", "killed"):
        outs[name] = tmp_path / name
        shutil.copytree(digits_root / "real", outs[name] / "digits" / "real")
    _stack_here(capsys, outs["whole"], *args)
    # SIGKILLed once the second member's first checkpoint is complete (both are mid-way)
    runs = outs["killed"] / "digits" / "train"
    kill_when(
        _stack(outs["killed"], *args), (runs / "k-s5" / "checkpoints" / "checkpoint_1").is_dir
    )
    assert not (runs / "k-s4" / "manifest.json").exists(), "finished before the kill"
    resumed = _stack_here(capsys, outs["killed"], *args)
    assert resumed.count("resumed from") == 2, resumed[-3000:]
    for seed in (4, 5):
        a, b = (outs[n] / "digits" / "train" / f"k-s{seed}" for n in ("whole", "killed"))
        for name in ("model.safetensors", "config.json", "manifest.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (seed, name)
        assert history(a) == history(b)


def test_seeds_on_the_command_line_train_a_stack_whose_runs_are_plain_runs(roots, capsys):
    stacked, alone = roots
    sets = [f"out={stacked.parent}", "run=cli", "seeds=6,7", "loss=ce", *TINY]
    assert main(["train", "--preset", "digits", "--set", *sets]) == 0
    assert f"done -> {stacked / 'train'}" in capsys.readouterr().out
    for seed in (6, 7):
        folder = stacked / "train" / f"cli-s{seed}"
        assert run_complete(folder, made_from(stacked))
        assert "seeds" not in json.loads((folder / "config.json").read_text())
        plain = [f"out={alone.parent}", f"run=cli-s{seed}", f"seed={seed}", "loss=ce", *TINY]
        single = run_stage("train", "digits", plain)
        assert (folder / "config.json").read_bytes() == (single / "config.json").read_bytes()
    with pytest.raises(ConfigError, match="must be distinct"):
        resolve_stage_config("train", "digits", ["seeds=1,1"])
