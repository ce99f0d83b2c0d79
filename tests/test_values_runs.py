"""Values that slip through, for the runs (issue 51, items 1 and 5 for train, finetune and
evaluate): a numeric field out of its range is refused before any work, a run that diverges
stops in one line with no manifest and its rerun with a fixed value starts clean, a run whose
weights or logits are not finite is refused naming it, evaluate's input paths are checked
before its work, and every command a hint quotes runs as printed.

Everything goes through the CLI (`pipeline.cli.main`) on the session's prepared digits, with
one-epoch runs on 64 images."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_TRAIN
from safetensors.torch import load_file, save_file

import stages.evaluate.stage
from core.config import ConfigError
from pipeline.cli import main
from pipeline.registry import resolve_stage_config as resolve_config
from shards.manifest import MANIFEST, ShardError
from shards.runs import META, WEIGHTS, finish_run
from shards.writer import check_config, claimed, write_config

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("values_runs")]
TINY = TINY_TRAIN  # conftest's tiny_ce_root was trained at it
QUOTED = re.compile(r"`(python -m pipeline [^`]*)`")


def one_line_error(capsys, argv: list[str], names: str, code: int = 1) -> str:
    """`main(argv)` exits `code` with exactly one `semix` error line, naming `names`, and no
    traceback; returns the line (the log lines before it start with a time)."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix")]
    assert rc == code, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and names in lines[0], err
    return lines[0]


def quoted(line: str) -> list[str]:
    """The semix arguments of the one `python -m pipeline ...` command a hint quotes."""
    commands = QUOTED.findall(line)
    assert len(commands) == 1, line
    argv = shlex.split(commands[0])
    assert argv[:3] == ["python", "-m", "pipeline"]
    return argv[3:]


@pytest.fixture(scope="module")
def trained(tiny_ce_root) -> Path:
    """runs/digits/ with real/ and one finished tiny train run `ce` (conftest's tiny_ce_root,
    shared with other modules): read-only, copy it."""
    return tiny_ce_root


def copy_root(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "digits")
    return tmp_path / "digits"


def rewrite_weights(run: Path, change) -> None:
    """Replace a complete run's weights by `change(state)` and write its manifest again, as a
    run trained to that state would hold (the sha256 checks pass: only the values are bad)."""
    state = change(load_file(str(run / WEIGHTS)))
    save_file(state, str(run / WEIGHTS))
    meta = json.loads((run / META).read_text())
    finish_run(run, meta["class_names"], json.loads((run / MANIFEST).read_text())["upstream"])


# ---------------------------------------------------------------- ranges, before any work


@pytest.mark.parametrize(
    ("stage", "value", "message"),
    [
        ("train", "optim.lr=nan", "optim.lr=nan is not a finite number; allowed: (0.0, inf)"),
        ("train", "optim.lr=inf", "optim.lr=inf is not a finite number; allowed: (0.0, inf)"),
        ("train", "optim.lr=0", "optim.lr=0.0 is out of range (0.0, inf)"),
        ("train", "lr=-1", "optim.lr=-1.0 is out of range (0.0, inf)"),  # the flat name too
        ("train", "optim.momentum=2", "optim.momentum=2.0 is out of range [0.0, 1.0)"),
        ("train", "optim.momentum=1", "optim.momentum=1.0 is out of range [0.0, 1.0)"),
        ("train", "optim.weight_decay=-1", "optim.weight_decay=-1.0 is out of range [0.0, inf)"),
        ("train", "optim.weight_decay=nan", "optim.weight_decay=nan is not a finite number"),
        ("train", "optim.lr_gamma=0", "optim.lr_gamma=0.0 is out of range (0.0, inf)"),
        ("train", "epochs=0", "epochs=0 is out of range [1, inf)"),
        ("train", "batch_size=0", "batch_size=0 is out of range [1, inf)"),
        ("train", "ls_alpha=1", "loss.ls.alpha=1.0 is out of range [0.0, 1.0)"),
        ("finetune", "maccal.lr=nan", "maccal.lr=nan is not a finite number; allowed: (0.0, inf)"),
        ("finetune", "fedlas.lr=0", "fedlas.lr=0.0 is out of range (0.0, inf)"),
        ("finetune", "optim.momentum=1", "optim.momentum=1.0 is out of range [0.0, 1.0)"),
        ("finetune", "maccal.epochs=0", "maccal.epochs=0 is out of range [1, inf)"),
    ],
)
def test_a_value_out_of_range_is_one_line_before_any_work(tmp_path, capsys, stage, value, message):
    argv = [stage, "--preset", "digits", "--set", f"out={tmp_path}", "run=r", value]
    line = one_line_error(capsys, argv, message, code=2)
    assert line == f"semix {stage}: error: {message}" or line.startswith(
        f"semix {stage}: error: {message}"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the run root


@pytest.mark.parametrize(
    ("stage", "sets", "path", "expected"),
    [  # the ends a range includes are taken
        ("train", ["optim.momentum=0"], "optim.momentum", 0.0),
        ("train", ["optim.weight_decay=0"], "optim.weight_decay", 0.0),
        ("train", ["ls_alpha=0"], "loss.ls.alpha", 0.0),
        ("train", ["optim.clip_norm=0"], "optim.clip_norm", 0.0),
        ("finetune", ["run=r", "optim.momentum=0.99"], "optim.momentum", 0.99),
    ],
)
def test_the_ends_a_range_includes_are_taken(stage, sets, path, expected):
    cfg = resolve_config(stage, "digits", sets)
    value = cfg
    for name in path.split("."):
        value = getattr(value, name)
    assert value == expected


def test_a_config_built_in_code_is_checked_too():
    """The range lives at the field: a config built without the CLI (a study, a test) gets it."""
    from stages.configs.train import Config

    with pytest.raises(ConfigError, match=r"^optim\.momentum=1\.5 is out of range \[0\.0, 1\.0\)$"):
        Config(run="r", **{"optim.momentum": 1.5})
    with pytest.raises(ConfigError, match=r"^optim\.lr=nan is not a finite number"):
        Config(run="r", lr=math.nan)


# ---------------------------------------------------------------- a diverged run


def test_a_diverged_run_stops_in_one_line_and_its_fix_starts_clean(trained, tmp_path, capsys):
    root = copy_root(trained, tmp_path)
    argv = ["train", "--preset", "digits", "--set", f"out={tmp_path}", *TINY, "run=big"]
    line = one_line_error(capsys, [*argv, "optim.lr=1e30"], "train big: the loss is")
    assert re.search(r"the loss is (nan|inf) at epoch 1, step [12] of 2: the run diverged", line)
    assert "optim.lr=1e+30 too large" in line and "rerun with a smaller optim.lr" in line
    run = root / "train" / "big"
    assert not (run / MANIFEST).exists()  # never complete
    assert not list((run / "checkpoints").glob("checkpoint_*"))  # no NaN checkpoint to resume
    assert json.loads((run / "config.json").read_text())["lr"] == 1e30
    # the rerun with a fixed lr is not "a run with a different config": it replaces the folder
    assert main([*argv, "optim.lr=0.05"]) == 0
    err = capsys.readouterr().err
    assert (
        f"{run}: replaced (it never completed (no manifest) and was made with optim.lr=1e+30;"
        in err
    )
    assert (run / MANIFEST).is_file()
    assert json.loads((run / "config.json").read_text())["lr"] == 0.05
    # complete now: another config is refused again, naming the field
    line = one_line_error(capsys, [*argv, "optim.lr=0.5"], "holds a run with a different config")
    assert "(differs in: optim.lr): it has optim.lr=0.05, this one asks optim.lr=0.5" in line


def test_a_diverged_fine_tuning_names_its_run_and_lr_field(trained, tmp_path, capsys):
    copy_root(trained, tmp_path)
    argv = ["finetune", "--preset", "digits", "--set", f"out={tmp_path}", "run=ce"]
    line = one_line_error(
        capsys, [*argv, "maccal.epochs=1", "maccal.lr=1e30"], "finetune ce-maccal: "
    )
    assert "the run diverged" in line and "rerun with a smaller maccal.lr" in line
    assert not (tmp_path / "digits" / "finetune" / "ce-maccal" / MANIFEST).exists()
    assert "acc and conf" not in line


# ---------------------------------------------------------------- runs that are not finite


def test_a_run_with_nan_weights_is_refused_by_finetune_and_evaluate(trained, tmp_path, capsys):
    root = copy_root(trained, tmp_path)
    run = root / "train" / "ce"

    def poison(state):
        name = next(k for k, v in state.items() if v.is_floating_point())
        return state | {name: torch.full_like(state[name], math.nan)}

    rewrite_weights(run, poison)
    base = ["--preset", "digits", "--set", f"out={tmp_path}", "run=ce"]
    line = one_line_error(
        capsys, ["finetune", *base, "maccal.epochs=1"], f"{run / WEIGHTS} holds non-finite"
    )
    assert "the run diverged" in line and "acc and conf" not in line
    line = one_line_error(capsys, ["evaluate", *base], f"{run / WEIGHTS} holds non-finite")
    assert not (root / "eval").exists()
    # the hint: remove the run and rebuild it with the quoted command (kept tiny here)
    assert f"remove {run} and rebuild the run" in line
    shutil.rmtree(run)
    assert main([*quoted(line), *TINY]) == 0
    assert main(["evaluate", *base]) == 0


def test_evaluate_refuses_non_finite_logits_naming_the_run(trained, tmp_path, capsys):
    root = copy_root(trained, tmp_path)
    run = root / "train" / "ce"

    def overflow(state):  # finite weights whose logits overflow float32
        last = [k for k, v in state.items() if v.is_floating_point() and v.ndim == 2][-1]
        return state | {last: state[last].sign() * 3e38}

    rewrite_weights(run, overflow)
    argv = ["evaluate", "--preset", "digits", "--set", f"out={tmp_path}", "run=ce"]
    line = one_line_error(capsys, argv, f"run 'ce' ({run}) gives non-finite logits on real/")
    assert not (root / "eval").exists()  # no evaluation, no report.md with a NaN row
    assert "with a smaller lr" in line


# ---------------------------------------------------------------- evaluate's inputs and hints


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("corruptions=/nope", "corruptions=/nope: no such folder; give a folder of"),
        ("ood=/nope", "ood=/nope: no prepared split there"),
    ],
)
def test_evaluate_checks_its_input_paths_before_any_work(
    trained, tmp_path, capsys, monkeypatch, value, message
):
    root = copy_root(trained, tmp_path)

    def measured(*args, **kwargs):
        raise AssertionError("measured before the input paths were checked")

    monkeypatch.setattr(stages.evaluate.stage, "measure", measured)
    argv = ["evaluate", "--preset", "digits", "--set", f"out={tmp_path}", "run=ce", value]
    line = one_line_error(capsys, argv, message)
    assert "leave" in line  # names a fix
    assert not (root / "eval").exists()


def test_evaluate_stage_dir_pinned_to_the_other_folder_quotes_a_command_that_works(
    trained, tmp_path, capsys
):
    root = copy_root(trained, tmp_path)
    argv = ["evaluate", "--preset", "digits", "--set", f"out={tmp_path}", "run=ce"]
    line = one_line_error(capsys, [*argv, "stage_dir=finetune"], f"but in {root / 'train' / 'ce'}")
    assert main(quoted(line)) == 0  # as printed
    assert (root / "eval" / "train" / "ce" / MANIFEST).is_file()


def test_stage_dir_lists_real_choices(tmp_path, capsys):
    argv = ["evaluate", "--preset", "digits", "--set", f"out={tmp_path}", "stage_dir=bogus"]
    line = one_line_error(capsys, argv, "stage_dir='bogus' is not valid", code=2)
    assert line.endswith('choose one of: "" (empty), train, finetune')


def test_the_start_over_hint_names_what_exists():
    """`--set checkpoint.resume=` is the field's current path and starts over; make's SET
    passes it (the Makefile has no RESUME variable)."""
    from shards.checkpoints import START_OVER

    assert "--set checkpoint.resume= (make: SET=checkpoint.resume=)" in START_OVER
    assert resolve_config("train", "digits", ["checkpoint.resume="]).checkpoint.resume == ""
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "$(SET)" in makefile and "RESUME" not in makefile


# ---------------------------------------------------------------- the completion rule


def test_only_a_complete_folder_defends_its_config(tmp_path):
    folder = tmp_path / "out"
    write_config(folder, {"seed": 0, "lr": 1.0})
    (folder / "partial.tar").write_bytes(b"x")
    assert not claimed(folder) and not check_config(folder, {"seed": 0, "lr": 2.0})
    write_config(folder, {"seed": 0, "lr": 2.0})  # replaced: nobody's output was there
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    (folder / MANIFEST).write_text("{}")
    assert claimed(folder)
    with pytest.raises(ShardError, match=r"differs in: lr\): it has lr=2\.0, this one asks lr=3"):
        write_config(folder, {"seed": 0, "lr": 3})


def test_a_folder_of_parts_is_complete_only_with_every_part(tmp_path):
    """prepare's real/: complete when each split has its manifest (`parts`)."""
    folder, parts = tmp_path / "real", ("train", "val", "test")
    write_config(folder, {"image_size": 0}, parts=parts)
    for split in parts[:2]:
        (folder / split).mkdir()
        (folder / split / MANIFEST).write_text("{}")
    assert not claimed(folder, parts)
    write_config(folder, {"image_size": 32}, parts=parts)  # replaced
    assert not (folder / "train").exists()
    for split in parts:
        (folder / split).mkdir()
        (folder / split / MANIFEST).write_text("{}")
    with pytest.raises(ShardError, match="differs in: image_size"):
        write_config(folder, {"image_size": 28}, parts=parts)
