"""Inputs that change, break or mislead: the user's data guarded (a changed source, one class,
16-bit images, val/, hidden folders, keys the source never reads, bad environment values),
damaged outputs that never loop (a rerun checks what its manifest pins, and the printed fix
works when followed), and hints and records that tell the truth (every printed command keeps
the user's root; the precision a run computed in is on disk)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main

QUOTED = re.compile(r"`(python -m pipeline [^`]*)`")
TINY = ["epochs=1", "train_limit=64", "batch_size=32"]


def error_line(capsys, argv: list[str], code: int = 1) -> str:
    """`main(argv)` fails with `code` in one line and no traceback; that line."""
    got = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix ")]
    assert got == code and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def quoted(line: str) -> list[list[str]]:
    """The semix arguments of each `python -m pipeline ...` a line quotes."""
    return [shlex.split(cmd)[3:] for cmd in QUOTED.findall(line)]


def resolved(capsys, args: list[str]) -> dict:
    """What a command resolves to (--print-config), with its run root as "root"."""
    assert main([*args, "--print-config"]) == 0, (args, capsys.readouterr().err)
    config = json.loads(capsys.readouterr().out)
    return config | {"root": str(Path(config["out"]) / (config["name"] or config["preset"]))}


def prepared(digits_root: Path, out: Path) -> Path:
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    return out / "digits"


# ---------------------------------------------------------------- damaged outputs never loop


def test_a_truncated_weights_file_is_named_on_rerun_and_the_fix_works(
    digits_root, tmp_path, capsys
):
    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    argv = ["train", "--preset", "digits", "--set", f"out={out}", "loss=ce", *TINY]
    assert main(argv) == 0
    folder = root / "train" / "ce"
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()

    line = error_line(capsys, argv)  # never "already finished"
    assert str(weights) in line and f"remove {folder} and rerun the same command" in line

    # a reader names it too, with a command that makes the run again in the user's root
    line = error_line(capsys, ["evaluate", "--preset", "digits", "--set", f"out={out}", "run=ce"])
    assert str(weights) in line and f"remove {folder}" in line
    (command,) = quoted(line)
    assert command[0] == "train" and resolved(capsys, command)["root"] == str(root)

    shutil.rmtree(folder)  # the fix, as printed
    assert main(argv) == 0
    from shards.runs import read_run

    assert read_run(folder).state_dict()  # complete again, its weights match the manifest


def test_a_truncated_shard_is_named_on_rerun_and_the_printed_command_rebuilds_it(
    digits_root, tmp_path, capsys
):
    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    shard = sorted((root / "real" / "val").glob("*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[:512])
    argv = ["prepare", "--preset", "digits", "--set", f"out={out}"]

    line = error_line(capsys, argv)
    assert str(shard) in line and "truncated" in line and "remove the folder" in line
    (command,) = quoted(line)
    shutil.rmtree(shard.parent)  # the fix, as printed
    assert main(command) == 0
    from shards.manifest import verify_shards

    verify_shards(root / "real" / "val")


# ---------------------------------------------------------------- hints keep the user's root

HINTS = {
    "evaluate an untrained run": ("evaluate", ["--preset", "digits"], ["run=nope"]),
    "evaluate under name=": ("evaluate", ["--preset", "digits"], ["name=foo", "run=nope"]),
    "evaluate with a recipe": (
        "evaluate",
        ["--preset", "digits", "--recipe", "fashion-mnist"],
        ["run=nope"],
    ),
    "evaluate with no runs": ("evaluate", ["--preset", "digits"], []),
    "finetune an untrained run": ("finetune", ["--preset", "digits"], ["name=foo", "run=nope"]),
}


@pytest.mark.parametrize("case", sorted(HINTS))
def test_every_printed_command_keeps_the_users_root_and_run(case, tmp_path, capsys):
    """Each hint quotes a command that resolves (--print-config) to the user's own out= and
    name=, and to the run it was asked about."""
    stage, preset, sets = HINTS[case]
    argv = [stage, *preset, "--set", f"out={tmp_path}", *sets]
    root = resolved(capsys, argv)["root"]
    line = error_line(capsys, argv)
    assert "make train" not in line and "RUN=" not in line, line
    (command,) = quoted(line)
    assert command[0] == "train", line
    config = resolved(capsys, command)
    assert config["root"] == root, line
    if "run=nope" in sets:
        assert config["run"] == "nope", line


# ---------------------------------------------------------------- the precision on disk


@pytest.mark.parametrize("launcher, computed", [("", "fp32"), ("bf16", "bf16")])
def test_host_json_says_the_precision_the_run_computed_in(
    launcher, computed, digits_root, tmp_path, capsys, monkeypatch
):
    """config.json keeps `auto`; host.json says what it became (on this CPU: fp32; under
    accelerate launch --mixed_precision bf16, which sets ACCELERATE_MIXED_PRECISION: bf16)."""
    if launcher:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    argv = ["train", "--preset", "digits", "--set", f"out={out}", "loss=ce", *TINY]
    assert main(argv) == 0, capsys.readouterr().err
    folder = root / "train" / "ce"
    assert json.loads((folder / "config.json").read_text())["precision"] == "auto"
    assert json.loads((folder / "host.json").read_text())["precision"] == computed


def test_a_precision_conflict_with_accelerate_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """What `accelerate launch --mixed_precision fp16 -m pipeline train --set precision=fp32`
    gives semix (accelerate sets ACCELERATE_MIXED_PRECISION): one line, exit 2, no work."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    argv = ["train", "--preset", "digits", "--set", f"out={tmp_path}", "precision=fp32"]
    line = error_line(capsys, argv, code=2)
    assert "precision=fp32 conflicts with accelerate launch's mixed precision 'fp16'" in line
    assert not (tmp_path / "digits" / "train").exists()


# ---------------------------------------------------------------- semix's environment


@pytest.mark.parametrize(
    "name, value",
    [
        ("SEMIX_PROGRESS", "bogus"),
        ("SEMIX_DEBUG", "yes"),
        ("SEMIX_NO_PROGRESS", "true"),
        ("SEMIX_PROGRESS_EVERY", "often"),
        ("SEMIX_DIST_TIMEOUT", "-5"),
    ],
)
def test_a_value_semix_cannot_use_in_its_environment_is_one_line(
    name, value, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv(name, value)
    line = error_line(capsys, ["prepare", "--preset", "digits", "--set", f"out={tmp_path}"], 2)
    assert f"{name}={value!r} is not valid" in line
    assert not (tmp_path / "digits").exists()  # before any work


def test_the_values_semix_takes_pass_the_environment_check():
    from core.environment import check_environment

    check_environment({})
    check_environment(
        {
            "SEMIX_PROGRESS": "Log",
            "SEMIX_DEBUG": "0",
            "SEMIX_NO_PROGRESS": "1",
            "SEMIX_PROGRESS_EVERY": "2.5",
            "SEMIX_DIST_TIMEOUT": "600",
            "SEMIX_SOMETHING_ELSE": "anything",  # not semix's: a script's own
        }
    )
