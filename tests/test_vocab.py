"""One vocabulary (issue 52, items 2 and 3): finetune's MaC-Cal and FeDLaS parameters are
leaves at the paths train uses, every spelling --set takes is listed by --fields, and the
messages name a key as the user types it (its path), after the stage's prefix."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from core.config import SAID, ConfigError, RenamedField
from pipeline.cli import main
from shards.manifest import ShardError, remake_command
from stages.common.fidelity import cnn_judge
from stages.configs import finetune as finetune_config
from stages.configs import train as train_config

BASE = ["finetune", "--preset", "digits", "--set", "run=x"]


def printed(capsys, argv: list[str]) -> tuple[dict, list[str]]:
    """`main(argv)` with --print-config: (the config, the notes it printed, as the CLI formats
    them: pytest records the warnings before they reach stderr)."""
    SAID.clear()  # a flat name is said once per process: maybe already, by another test
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main([*argv, "--print-config"]) == 0
    notes = [
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno).rstrip("\n")
        for w in said
        if w.category is RenamedField
    ]
    return json.loads(capsys.readouterr().out), notes


def error_line(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "typed, said",
    [
        ("loss.fedlas_ls.alpha=0.2", []),  # train's path
        ("objective.alpha=0.2", []),  # the picked objective's
        ("objective.fedlas-ls.alpha=0.2", []),
        ("fedlas_ls_alpha=0.2", ["semix finetune: fedlas_ls_alpha is now loss.fedlas_ls.alpha"]),
        ("method.alpha=0.2", ["semix finetune: method is now objective"]),  # the old word
    ],
)
def test_finetune_takes_trains_path_and_every_older_spelling(capsys, typed, said):
    cfg, err = printed(capsys, [*BASE, "objective=fedlas-ls", typed])
    assert cfg["loss"]["fedlas_ls"] == {"alpha": 0.2, "beta": 4.0, "theta": 0.95}
    assert cfg["loss"]["fedlas_mbls"]["alpha"] == 0.1  # the other loss's own α untouched
    assert err == said


def test_finetune_maccal_schedule_is_its_sections(capsys):
    notes = {
        "maccal_q0=0.7": ["semix finetune: maccal_q0 is now maccal.q0"],
        "method.q0=0.7": ["semix finetune: method is now objective"],
    }
    for typed in ("maccal.q0=0.7", "objective.q0=0.7", "maccal_q0=0.7", "method.q0=0.7"):
        cfg, err = printed(capsys, [*BASE, typed])
        assert cfg["maccal"]["q0"] == 0.7 and cfg["maccal"]["r"] == 256, typed
        assert err == notes.get(typed, []), typed


def test_finetunes_old_word_method_is_said_once_and_names_the_objective(capsys):
    cfg, err = printed(capsys, [*BASE, "method=fedlas-ls", "method.alpha=0.2"])
    assert cfg["objective"] == "fedlas-ls" and "method" not in cfg  # --print-config: the tree
    assert cfg["loss"]["fedlas_ls"]["alpha"] == 0.2
    assert err == ["semix finetune: method is now objective"]


def test_a_fedlas_parameter_has_one_path_and_one_recorded_name_in_both_stages():
    trained = train_config.Config(run="x", **{"loss.fedlas_mbls.margin": 4.0})
    tuned = finetune_config.Config(run="x", **{"loss.fedlas_mbls.margin": 4.0})
    assert trained.loss.fedlas_mbls.margin == tuned.loss.fedlas_mbls.margin == 4.0
    assert trained.recorded()["fedlas_margin"] == tuned.recorded()["fedlas_margin"] == 4.0


def test_finetune_bad_values_name_their_path(capsys, tmp_path):
    base = [*BASE, f"out={tmp_path}"]  # refused before any folder is read
    line = error_line(capsys, [*base, "fedlas_ls_alpha=-1"])  # the flat name: its path
    assert line.startswith("semix finetune: error: loss.fedlas_ls.alpha=-1.0 is out of range")
    line = error_line(capsys, [*base, "maccal.q_min=0.95"])
    assert line.startswith("semix finetune: error: need 0 <= maccal.q_min <= maccal.q0")


def test_fields_lists_every_spelling_a_leaf_takes(capsys):
    assert main(["finetune", "--fields"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "maccal_q0" not in rows and "fedlas_ls_alpha" not in rows  # paths head the rows
    assert "method" not in rows and rows["objective"].endswith("also: method")
    assert rows["maccal.q0"].endswith(
        "also: maccal_q0, objective.maccal.q0, objective.q0 (objective=maccal), "
        "method.maccal.q0, method.q0 (objective=maccal)"
    )
    alpha = (
        "also: fedlas_ls_alpha, objective.fedlas-ls.alpha, objective.alpha (objective=fedlas-ls), "
        "method.fedlas-ls.alpha, method.alpha (objective=fedlas-ls)"
    )
    assert rows["loss.fedlas_ls.alpha"].endswith(alpha)
    assert rows["optim.momentum"].endswith("also: momentum")
    # every spelling listed is one --set takes, for that leaf
    for path in ("maccal.q0", "loss.fedlas_ls.theta", "loss.fedlas_mbls.margin"):
        words = rows[path].rpartition("also: ")[2]
        for word in words.split(", "):
            key, _, picked = word.partition(" (objective=")
            objective = picked.rstrip(")").split("|")[0] if picked else "fedlas-mbls"
            cfg, _ = printed(capsys, [*BASE, f"objective={objective}", f"{key}=0.31"])
            head, _, rest = path.partition(".")
            leaf = cfg[head]
            for name in rest.split("."):
                leaf = leaf[name]
            assert leaf == 0.31, (path, word)


def test_a_finetune_runs_remake_command_names_its_objective(tmp_path):
    """A hint that remakes a fine-tuning says `objective=`, read from config.json's `method`."""
    folder = tmp_path / "digits" / "finetune" / "ce-maccal"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"run": "ce", "method": "maccal"}))
    stage, command = remake_command(folder)
    assert stage == "finetune" and command.endswith(" run=ce objective=maccal"), command


def test_a_rename_note_says_the_stage():
    """On the real stderr of the command: the note after the stage's prefix, then the config."""
    argv = [sys.executable, "-m", "pipeline", "train", "--set", "lr=0.5", "--print-config"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["semix train: lr is now optim.lr"]
    assert json.loads(done.stdout)["optim"]["lr"] == 0.5


def test_a_judge_that_is_no_trained_run_is_named_by_its_path(tmp_path):
    with pytest.raises(ShardError) as e:
        cnn_judge(tmp_path, "ghost", "cpu")
    assert str(e.value).startswith("fidelity.judge=ghost: ")
    assert str(e.value).endswith("or set fidelity.judge= to another run or to nothing")
    assert "judge_run" not in str(e.value)


def test_a_precision_conflict_names_the_precision_field(monkeypatch):
    from stages.common.loop import accelerate_precision

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ConfigError, match=r"^precision=fp32 conflicts .* leave precision=auto"):
        accelerate_precision("fp32", cpu=True)
