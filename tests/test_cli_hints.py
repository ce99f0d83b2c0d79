"""Hints that are true (issue 31, item 4): every command a one-line error quotes runs as
printed, and a folder the user named (mixed=, series=, model=) that does not exist is named as
missing, not answered with "run <stage> first" for the run root's own folder. Nothing trains:
each stage stops at its input check."""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.cli import main

QUOTED = re.compile(r"`(python -m pipeline [^`]*)`")


def error_line(capsys, argv: list[str]) -> str:
    """`main(argv)` fails in one line; that line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix ")]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def quoted_commands(line: str) -> list[list[str]]:
    """The semix arguments of each `python -m pipeline ...` a hint quotes."""
    return [shlex.split(cmd)[3:] for cmd in QUOTED.findall(line)]


def runs_as_printed(capsys, line: str, words_only: bool = False) -> None:
    """Every command the hint quotes runs with --print-config; it quotes one unless
    `words_only` (nothing records a value the command would need)."""
    commands = quoted_commands(line)
    assert commands or words_only, f"the hint quotes no command: {line}"
    for args in commands:
        code = main([*args, "--print-config"])
        assert code == 0, f"`{' '.join(args)}` from {line!r}: {capsys.readouterr().err}"
        capsys.readouterr()


# ---------------------------------------------------------------- scenarios

# each: (what it sets up in a fresh out= folder, the command line that then fails)
Setup = Callable[[Path, Path], None]


def nothing(out: Path, real: Path) -> None:
    pass


def real_only(out: Path, real: Path) -> None:
    shutil.copytree(real, out / "digits" / "real")


def real_under(name: str) -> Setup:
    """real/ in a run root named `name` (its config.json records the preset digits)."""
    return lambda out, real: shutil.copytree(real, out / name / "real")


def incomplete_val(out: Path, real: Path) -> None:
    real_only(out, real)
    (out / "digits" / "real" / "val" / "manifest.json").unlink()


def damaged_val(out: Path, real: Path) -> None:
    real_only(out, real)
    shard = sorted((out / "digits" / "real" / "val").glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


SCENARIOS = {
    "train before prepare": (nothing, "train", []),
    "generate before fit-generator": (real_only, "generate", []),
    "annotate before generate": (real_only, "annotate", []),
    "csm before annotate": (real_only, "train", ["loss=csm"]),
    "csm before annotate, root name=mine": (real_under("mine"), "train", ["name=mine", "loss=csm"]),
    "train, real/val incomplete": (incomplete_val, "train", []),
    "train, a damaged real/val shard": (damaged_val, "train", []),
}
# where nothing records a value the command needs (the preset of an unprepared root under another
# name, the loss of a run never trained), the hint says what to run in words, or quotes a
# command that needs no such value
UNRECORDED = {
    "train before prepare, root name=mine": (nothing, "train", ["name=mine"]),
    "evaluate a run never trained": (real_only, "evaluate", ["run=nope"]),
}


def scenario(capsys, tmp_path, real: Path, setup: Setup, stage: str, sets: list[str]) -> str:
    """The error line of `stage` in a fresh out= folder prepared by `setup`."""
    out = tmp_path / "runs"
    out.mkdir()
    setup(out, real)
    return error_line(capsys, [stage, "--preset", "digits", "--set", f"out={out}", *sets])


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_command_a_hint_quotes_runs_as_printed(name, digits_root, tmp_path, capsys):
    line = scenario(capsys, tmp_path, digits_root / "real", *SCENARIOS[name])
    runs_as_printed(capsys, line)


@pytest.mark.parametrize("name", UNRECORDED)
def test_hints_quote_no_placeholder(name, digits_root, tmp_path, capsys):
    line = scenario(capsys, tmp_path, digits_root / "real", *UNRECORDED[name])
    assert "<" not in line and " first" in line
    runs_as_printed(capsys, line, words_only=True)


def test_the_collector_sees_what_it_checks(capsys):
    line = "x: run prepare first: `python -m pipeline prepare --preset digits --set out=/a b=1`"
    assert quoted_commands(line) == [["prepare", "--preset", "digits", "--set", "out=/a", "b=1"]]
    with pytest.raises(AssertionError, match="from"):  # a command semix refuses fails it
        runs_as_printed(capsys, "`python -m pipeline train --preset <preset>`")


# ---------------------------------------------------------------- folders the user named


@pytest.mark.parametrize(
    ("argv", "field", "default"),
    [
        (["train", "loss=csm", "mixed=/nope/mixed"], "mixed", "mixed"),
        (["annotate", "series=/nope/series"], "series", "series"),
        (["generate", "model=/nope/generator"], "model", "generator"),
    ],
)
def test_a_named_folder_that_does_not_exist_is_named_as_missing(
    argv, field, default, digits_root, tmp_path, capsys
):
    """`train loss=csm mixed=/nope/mixed` used to say "run annotate first: `python -m pipeline
    annotate --preset <preset> --set out=/ name=nope`"."""
    out = tmp_path / "runs"
    real_only(out, digits_root / "real")
    stage, *sets = argv
    line = error_line(capsys, [stage, "--preset", "digits", "--set", f"out={out}", *sets])
    assert line.startswith(f"semix {stage}: error: {field}=/nope/{default}: no such file or folder")
    assert str(out / "digits" / default) in line  # where the default would be
    assert "first" not in line and not quoted_commands(line)
    assert main([stage, "--preset", "digits", "--set", f"out={out}", *sets]) == 2
    capsys.readouterr()


def test_a_named_generator_folder_without_a_manifest_is_not_sent_to_fit_generator(
    digits_root, tmp_path, capsys
):
    out = tmp_path / "runs"
    real_only(out, digits_root / "real")
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    line = error_line(capsys, ["generate", "--set", f"out={out}", f"model={elsewhere}"])
    assert f"no trained generator in {elsewhere} (no manifest.json)" in line
    assert "point model= at a folder fit-generator completed" in line
    assert not quoted_commands(line)
