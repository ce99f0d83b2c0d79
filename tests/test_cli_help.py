"""Help that teaches (issue 31, item 3): `semix <stage> --help` shows what the stage is for, its
fields grouped with their descriptions and choices, the presets and examples that run; a typo
gets a "did you mean"; --print-config shows every field --fields lists; a missing --preset is
said once; an empty out= is refused; a closed pipe ends quietly. Nothing here trains."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from core.tree import leaves, shown
from pipeline.cli import COMMANDS, STAGES, main
from pipeline.registry import config_module
from stages.presets import NAMES as PRESET_NAMES

NAMES = [*STAGES, *COMMANDS]


def one_error(capsys, argv: list[str], code: int = 2) -> str:
    """`main(argv)` fails with `code` and exactly one line on stderr; that line."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def section(text: str, title: str) -> list[str]:
    """The indented lines under `title` in a help text, up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    return [line for line in lines[start:][: lines[start:].index("")]]


# ---------------------------------------------------------------- semix <stage> --help


def test_train_help_shows_purpose_fields_choices_presets_and_examples(capsys):
    from stages.configs.train import LOSS, Config

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    # the purpose: the first line of stages/train.py's docstring, read here with a regex
    first = re.search(r'^"""train: (.+)$', (REPO / "stages" / "train.py").read_text(), re.M)
    assert out.splitlines()[0] == f"semix train: {first.group(1)}"
    assert all(name in out for name in PRESET_NAMES)
    examples = section(out, "examples:")
    assert len(examples) == 2 and all("-m pipeline train" in line for line in examples)
    # every field once, in two groups: train's own and the shared ones
    own = section(out, "train's fields")
    shared = section(out, "fields every stage shares")
    rows = [line.split()[0] for line in own + shared if not line.startswith("  --")]
    names = sorted(shown(Config, leaf.path) for leaf in leaves(Config) if leaf.path != "preset")
    assert sorted(r for r in rows if r != "field") == names
    assert {"out", "seed", "verify_sha256"} <= {line.split()[0] for line in shared}
    assert (
        "  -- recipe (docs/methods.md §3)" in own
    )  # the source's section comments head the groups
    # the losses are choices the config checks: the loss row lists every one
    (loss_row,) = [line for line in own if line.split()[0] == "loss"]
    assert all(loss in loss_row for loss in LOSS.names)


def test_help_names_the_samplers_of_the_backend_the_preset_uses(capsys):
    """Choices are recorded where the config checks them, so they follow the config: the edm
    backend's samplers are not the unet's."""
    from models.generators import EDM_SAMPLERS, SAMPLERS

    assert main(["generate", "--help"]) == 0
    (row,) = [
        line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["sampler"]
    ]
    assert all(s in row for s in SAMPLERS)
    assert main(["generate", "--fields", "--preset", "cifar10"]) == 0
    (row,) = [
        line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["backend"]
    ]
    assert all(b in row for b in ("unet", "sd", "dit", "edm"))
    assert set(EDM_SAMPLERS) != set(SAMPLERS)


@pytest.mark.parametrize("name", NAMES)
def test_every_help_runs_and_its_examples_resolve(name, capsys):
    """Each stage's and command's help, and every example it shows that is a whole command
    (no `...`, `[optional]` or `<placeholder>`), resolves with --print-config."""
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"semix {name}: ") and f"usage: semix {name} " in out
    examples = section(out, "examples:")
    assert len(examples) == 2
    for line in examples:
        command = line.split("#")[0]
        if re.search(r"[<>\[\]]|\.\.\.|…", command) or " -m pipeline " not in f" {command}":
            continue
        args = shlex.split(command.split(" -m pipeline ", 1)[1])
        code = main([*args, "--print-config"])
        assert code == 0, (line, capsys.readouterr().err)
        capsys.readouterr()


def test_semix_help_lists_every_stage_and_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [
        line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()
    ]
    assert all(name in listed for name in NAMES)


# ---------------------------------------------------------------- did you mean


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trian"], "unknown stage or command 'trian'; did you mean 'train'?"),
        (["train", "--set", "lossx=ce"], "unknown field 'lossx'; did you mean 'loss'?"),
        (["train", "--preset", "Digits"], "unknown preset 'Digits'; did you mean 'digits'?"),
        (["train", "--preset", "cifar-10"], "did you mean 'cifar10'?"),
        (["train", "--set", "loss=csn"], "loss='csn' is not valid; did you mean 'csm'?"),
        (["chain", "--set", "generate.stepz=3"], "did you mean 'generate.sample_steps'?"),
    ],
)
def test_a_typo_gets_one_line_with_a_guess(argv, needle, capsys):
    line = one_error(capsys, [*argv, "--print-config"])
    assert needle in line, line
    assert "valid fields" not in line  # the guess, not all 52 names


def test_a_key_with_no_close_field_still_lists_the_fields(capsys):
    line = one_error(capsys, ["prepare", "--print-config", "--set", "bogus=1"])
    assert "unknown field 'bogus'; valid fields: preset, out" in line


def test_a_misspelt_option_gets_a_guess(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--presett", "digits"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "did you mean '--preset'?" in err and "usage:" not in err


# ---------------------------------------------------------------- --print-config, --preset, out=


@pytest.mark.parametrize("stage", STAGES)
def test_print_config_shows_every_field_fields_lists(stage, capsys):
    """Fields a stage records only off their default (generate's mix_classes, lattice and
    endpoint_check, prepare's resize) are still shown: --print-config agrees with --fields."""
    required = ["--set", "run=ce"] if stage == "finetune" else []  # the run it fine-tunes
    assert main([stage, "--print-config", *required]) == 0
    shown = set(json.loads(capsys.readouterr().out))
    assert shown == {f.name for f in dataclasses.fields(config_module(stage).Config)}


def test_print_config_includes_default_valued_fields_a_stage_leaves_out_of_config_json(capsys):
    assert main(["generate", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    mixing, endpoint = cfg["mixing"], cfg["endpoint"]
    assert (mixing["mix_classes"], mixing["lattice"], endpoint["check"]) == (2, 0, "off")
    assert main(["prepare", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["resize"] == "squash"


def test_a_missing_preset_is_said_once(tmp_path, capsys):
    assert main(["train", "--set", f"out={tmp_path}"]) == 1  # no real/: fails after the note
    err = capsys.readouterr().err
    assert err.count("no --preset: using digits") == 1, err
    assert main(["train", "--preset", "digits", "--set", f"out={tmp_path}"]) == 1
    assert "no --preset" not in capsys.readouterr().err


@pytest.mark.parametrize("out", ["out=", "out=  "])
def test_an_empty_out_is_refused(out, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error(capsys, ["prepare", "--preset", "digits", "--set", out])
    assert line.startswith("semix prepare: error: out= is empty")
    assert list(tmp_path.iterdir()) == []  # nothing written in the working folder
    assert "out= is empty" in one_error(capsys, ["chain", "--print-config", "--set", out])


# ---------------------------------------------------------------- a closed pipe


@pytest.mark.parametrize("flag", ["--fields", "--help", "--print-config"])
def test_a_closed_pipe_ends_quietly_with_exit_0(flag):
    """`semix train --fields | head -1`: the reader goes away before semix writes (here it is
    closed before the interpreter starts, so the write always meets a closed pipe)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "train", flag],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), cwd=REPO,
    )  # fmt: skip
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == "", err
