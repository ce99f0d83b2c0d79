import json
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import subprocess_env

from core.config import (
    ConfigError,
    StageConfig,
    every_field,
    not_recorded,
    recorded_along,
    recorded_off_default,
)
from core.seeding import derive_seed, make_generator
from models.objectives import build_objective
from pipeline.cli import main
from pipeline.registry import resolve_stage_config


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


KEYS = [(0, "series", 3), (1, "series", 3), (0, "series", "3"), (7, "val-split"), (2**40, "x", 1.5)]


def test_derived_seeds_are_the_same_in_another_process_and_key_sensitive(tmp_path):
    """Stable across processes: another interpreter with another str-hash seed (which would
    change anything built on hash()) derives the same seeds."""
    code = (
        "import json, sys; from core.seeding import derive_seed; "
        "print(json.dumps([derive_seed(*k) for k in json.loads(sys.argv[1])]))"
    )
    env = subprocess_env() | {"PYTHONHASHSEED": "12345"}
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(KEYS)],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    here = [derive_seed(*k) for k in KEYS]
    assert json.loads(run.stdout) == here
    assert len(set(here)) == len(KEYS)  # seed, key parts, and int vs str all matter
    assert all(0 <= s < 2**63 for s in here)  # a valid torch.Generator seed
    assert len({derive_seed(0, "series", i) for i in range(1000)}) == 1000


def test_generators_from_the_same_key_draw_the_same_numbers():
    draws = [torch.randn(5, generator=make_generator(5, key)) for key in ("x", "x", "y")]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert make_generator(5, "x").initial_seed() == derive_seed(5, "x")


def test_train_mmce_normalization_reaches_the_objective_and_config_json_only_off_default():
    cfg = resolve_stage_config("train", "digits", ["loss=mmce_weighted"])
    assert cfg.loss.params() == {"lam": 2.0, "normalization": "paper"}
    assert "mmce_normalization" not in cfg.recorded()  # a default run's config.json keeps its bytes
    sets = ["loss=mmce_weighted", "mmce_normalization=focal_calibration"]
    cfg = resolve_stage_config("train", "digits", sets)
    assert cfg.loss.params() == {"lam": 2.0, "normalization": "focal_calibration"}
    assert cfg.recorded()["mmce_normalization"] == "focal_calibration"
    objective = build_objective(cfg.loss.name, 3, **cfg.loss.params())
    assert objective.criterion.normalization == "focal_calibration"
    with pytest.raises(ConfigError, match="choose one of: paper, focal_calibration"):
        resolve_stage_config("train", "digits", ["mmce_normalization=sum"])


@dataclass(frozen=True)
class _Toy(StageConfig):
    size: int = 3
    resume: str = not_recorded("auto")
    mode: str = recorded_off_default("plain")
    width: tuple[int, ...] = recorded_off_default(())
    knob: int = recorded_along(7, "mode")


@pytest.mark.parametrize(
    ("values", "extra"),
    [
        ({}, {}),
        ({"resume": "", "out": "/elsewhere", "name": "x", "verify_sha256": False}, {}),
        ({"mode": "fancy"}, {"mode": "fancy", "knob": 7}),
        ({"knob": 9}, {}),  # an option of mode: only with it
        (
            {"mode": "fancy", "knob": 9, "width": (2, 4)},
            {"mode": "fancy", "knob": 9, "width": [2, 4]},
        ),
    ],
)
def test_field_metadata_is_the_one_identity_rule(values, extra):
    """config.json (`recorded`) holds every field but those their metadata leaves out: where the
    root lives and how to start never, an added field only off its default, an option only
    with its field; --print-config (`every_field`) shows them all."""
    cfg = _Toy(preset="p", **values)
    base = {"preset": "p", "classes_file": "", "seed": 0, "cpu_threads": 0, "size": 3}
    assert cfg.recorded() == base | extra
    left_out = {"out", "name", "verify_sha256", "resume", "mode", "width", "knob"}
    assert set(every_field(cfg)) == set(base) | left_out


def test_no_config_changes_after_it_is_built():
    # guidance is a number or the word auto, parsed as such; train's run follows its loss
    # before the frozen config is built
    from pipeline.registry import resolve_stage_config

    assert resolve_stage_config("generate", "digits", ["guidance=2.5"]).guidance == 2.5
    assert resolve_stage_config("generate", "digits", ["guidance=auto"]).guidance == "auto"
    with pytest.raises(ConfigError, match=r"guidance='x' is not a valid float or 'auto'"):
        resolve_stage_config("generate", "digits", ["guidance=x"])
    assert resolve_stage_config("train", "digits", ["loss=focal"]).run == "focal"
    assert resolve_stage_config("train", "digits", ["loss=focal", "run=f2"]).run == "f2"
    configs = (pathlib.Path(__file__).parent.parent / "stages" / "configs").glob("*.py")
    assert not [p.name for p in configs if "object.__setattr__" in p.read_text()]
