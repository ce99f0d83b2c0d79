import json
import subprocess
import sys

import pytest
from conftest import subprocess_env

from pipeline.cli import main, resolve_stage_config
from pipeline.runtime import derive_seed, make_generator


def test_preset_and_sets_resolve_in_order():
    cfg = resolve_stage_config("prepare", "cifar10", ["shard_size=7", "val_fraction=0.25"])
    assert (cfg.preset, cfg.source, cfg.image_size) == ("cifar10", "cifar10", 32)
    assert (cfg.shard_size, cfg.val_fraction) == (7, 0.25)
    assert cfg.root.as_posix() == "runs/cifar10"


def test_classes_file_selects_imagefolder(tmp_path):
    f = tmp_path / "flowers.txt"
    f.write_text("rose\n# comment\ntulip\n\n")
    cfg = resolve_stage_config("prepare", str(f))
    assert (cfg.preset, cfg.name, cfg.classes_file) == ("imagefolder", "flowers", str(f))


@pytest.mark.parametrize(
    ("preset", "sets", "needle"),
    [
        ("mnist", [], "choose one of: digits, fashion-mnist, cifar10"),
        ("digits", ["bogus=1"], "unknown field 'bogus'; valid fields:"),
        ("digits", ["shard_size=many"], "not a valid int"),
        ("digits", ["source=svhn"], "choose one of: digits"),
        ("digits", ["val_fraction=0.9"], "out of range"),
        ("digits", ["shard_size"], "expects key=value"),
    ],
)
def test_bad_config_one_line_exit_2_nothing_written(tmp_path, capsys, preset, sets, needle):
    code = main(["prepare", "--preset", preset, "--set", f"out={tmp_path}", *sets])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_subprocess_exit_code_and_print_config(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", "prepare", "--preset", "nope"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert run.returncode == 2 and "unknown preset 'nope'" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", "prepare", "--preset", "digits", "--print-config"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert run.returncode == 0 and json.loads(run.stdout)["shard_size"] == 128


def test_derived_seeds_are_stable_and_key_sensitive():
    assert derive_seed(0, "series", 3) == derive_seed(0, "series", 3)
    assert len({derive_seed(0, "series", i) for i in range(100)}) == 100
    assert derive_seed(1, "series", 3) != derive_seed(0, "series", 3)
    a = make_generator(5, "x").initial_seed()
    assert a == make_generator(5, "x").initial_seed() != make_generator(5, "y").initial_seed()
