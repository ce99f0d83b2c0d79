"""Launchers' conventions: a rerun of complete work exits 0 under torchrun and accelerate
launch, every time; accelerate's mixed precision wins over semix's default and a conflict is one
line before any work; the shipped accelerate config files launch without accelerate's warning
block."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env
from test_multinode import (
    DEADLINE,
    accelerate_nodes,
    free_port,
    launch_each,
    node_dirs,
    torchrun_nodes,
)

from core.config import ConfigError
from core.precision import launcher_precision
from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "docs" / "accelerate"
# a launch that fails half the time passes RERUNS in a row with probability 0.5^7 < 1 %
RERUNS = 7


def _complete_root(digits_root: Path, tmp_path: Path) -> Path:
    """A runs root whose prepare is complete (what a resubmitted job finds)."""
    root = tmp_path / "runs"
    shutil.copytree(digits_root, root / "digits")
    return root


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        cwd=ROOT,
    )


def _prepare(root: Path) -> list[str]:
    return ["-m", "pipeline", "prepare", "--preset", "digits", "--set", f"out={root}"]


def test_rerun_of_complete_work_under_torchrun_exits_0_every_time(digits_root, tmp_path):
    """Both ranks find prepare complete and leave; the process group is torn down before the
    interpreter exits, so gloo's threads never abort the process (SIGABRT, "terminate called
    without an active exception") after the work is done."""
    root = _complete_root(digits_root, tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for attempt in range(RERUNS):
        r = _run([*torchrun, "--nproc_per_node", "2", *_prepare(root)])
        assert r.returncode == 0 and "terminate called" not in r.stderr, (attempt, r.stderr[-800:])


@pytest.mark.slow
def test_rerun_of_complete_work_on_two_nodes_exits_0_every_time(digits_root, tmp_path):
    root = _complete_root(digits_root, tmp_path)
    dirs = node_dirs(tmp_path)
    for attempt in range(RERUNS):
        argvs = [[*cmd, *_prepare(root)] for cmd in torchrun_nodes(free_port(), dirs)]
        nodes = launch_each(argvs, dirs)
        assert all(n.rc == 0 for n in nodes), (attempt, [n.err[-400:] for n in nodes])


@pytest.mark.slow
def test_rerun_of_complete_work_under_accelerate_on_two_machines_exits_0_every_time(
    digits_root, tmp_path
):
    """accelerate's torch launcher, 2 machines x 1 process on loopback (on a CPU machine
    accelerate needs one process per machine for --multi_gpu)."""
    root = _complete_root(digits_root, tmp_path)
    dirs = node_dirs(tmp_path)
    for attempt in range(RERUNS):
        argvs = [[*cmd, *_prepare(root)] for cmd in accelerate_nodes(free_port())]
        nodes = launch_each(argvs, dirs)
        assert all(n.rc == 0 for n in nodes), (attempt, [n.err[-400:] for n in nodes])


def test_accelerate_launch_with_a_shipped_config_reruns_quietly(digits_root, tmp_path):
    """The shipped CPU config: no "values were not passed" block, exit 0 on complete work."""
    root = _complete_root(digits_root, tmp_path)
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    r = _run([*launch, "--config_file", str(CONFIGS / "cpu.yaml"), *_prepare(root)])
    assert r.returncode == 0, r.stderr[-800:]
    assert "were not passed" not in r.stderr + r.stdout


def test_accelerate_cpu_launcher_without_ranks_runs_as_one_process(digits_root, tmp_path):
    """`accelerate launch --cpu --num_processes 2` on one machine starts one process without a
    rank (no mpirun): it does the work as a plain run, said in one line, and exits 0."""
    root = _complete_root(digits_root, tmp_path)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    more = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    r = _run([*launch, *more, *_prepare(root)])
    assert r.returncode == 0, r.stderr[-800:]
    assert r.stderr.count("torchrun --nproc_per_node N") == 1
    assert "Traceback" not in r.stderr


def test_shipped_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = {p.stem: load_config_from_file(str(p)) for p in sorted(CONFIGS.glob("*.yaml"))}
    assert set(configs) == {"cpu", "one-node-gpus", "two-nodes"}
    assert configs["cpu"].use_cpu and configs["cpu"].num_processes == 1
    assert configs["two-nodes"].num_machines == 2
    assert {c.mixed_precision for n, c in configs.items() if n != "cpu"} == {"bf16"}


@pytest.mark.parametrize(
    ("launcher", "value", "resolved", "expected"),
    [
        ("", "auto", "bf16", "bf16"),  # no accelerate launch: semix's own choice
        ("fp16", "auto", "bf16", "fp16"),  # accelerate's flag or config wins over auto
        ("no", "auto", "bf16", "no"),  # accelerate's default too (its convention)
        ("bf16", "bf16", "bf16", "bf16"),  # the same value twice is no conflict
    ],
)
def test_accelerate_precision_wins_over_auto(monkeypatch, launcher, value, resolved, expected):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    assert launcher_precision("precision", value, resolved) == expected


def test_precision_conflict_with_accelerate_is_one_line_before_any_work(
    monkeypatch, capsys, digits_root, tmp_path
):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ConfigError, match="conflicts with accelerate launch's mixed precision"):
        launcher_precision("precision", "fp32", "no")
    root = _complete_root(digits_root, tmp_path)
    sets = [f"out={root}", "run=p", "epochs=1", "precision=fp32", "train_limit=64"]
    code = main(["train", "--preset", "digits", "--set", *sets])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "precision=fp32 conflicts" in err
    assert not (root / "digits" / "train" / "p" / "manifest.json").exists()
