"""Presets in one place (stages/presets): nothing below the stages names one, a preset extends
another, and `--recipe` runs a preset's recipe on other data: the study on a tiny ImageFolder
of one's own, resolved in full and prepared for real."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, string_literals
from PIL import Image

import pipeline.study.plan
import stages.presets as presets
from core.config import every_field
from core.tree import leaves, shown
from pipeline.cli import main
from pipeline.registry import STAGES, config_module, resolve_stage_config
from shards.reader import load_split

RECIPE = "imagefolder+fashion-mnist"  # what `--preset imagefolder --recipe fashion-mnist` names
# the modules outside stages/presets that still name a preset: both name scikit-learn's digits
# as the far-OOD data set (stages/ood.py builds it, the study plans the robustness table's on it)
NAMING_ALLOWED = {"stages/ood.py", "pipeline/study/plan.py"}


def test_only_the_presets_name_a_preset():
    """A preset's name as a string value appears under stages/presets/ and nowhere below the
    stages (models, shards, core); elsewhere only where the digits data are a far-OOD set."""
    naming = sorted(
        str(path.relative_to(REPO))
        for package in ("core", "models", "shards", "stages", "pipeline")
        for path in (REPO / package).rglob("*.py")
        if "presets" not in path.relative_to(REPO).parts
        and {text for _, text in string_literals(path)} & set(presets.NAMES)
    )
    assert not [m for m in naming if m.split("/")[0] in ("core", "models", "shards")], naming
    assert set(naming) <= NAMING_ALLOWED, naming


def test_presets_give_their_values_by_path():
    """A preset names each leaf by its path as --set takes it (`optim.lr`, `loss.mbls.m`, `loss`
    for loss.name): its values, its `when` conditions and values, its chain's --set values;
    never by a name config.json records (`mbls_margin`: the codec's, core/codec.py)."""
    for stage in STAGES:
        config = config_module(stage).Config
        paths = {shown(config, leaf.path) for leaf in leaves(config)}
        for name in presets.NAMES:
            values = dict(presets.resolved(name).stages.get(stage, {}))
            when = values.pop("when", {})
            keys = {*values, *(condition.partition("=")[0] for condition in when)}
            keys |= {key for overrides in when.values() for key in overrides}
            chain = [sets for step, sets in presets.chain_steps(name) if step == stage]
            keys |= {item.partition("=")[0] for sets in chain for item in sets}
            assert keys <= paths, (stage, name, sorted(keys - paths))


def test_a_preset_extends_another_recipe_not_data():
    """cifar100 starts from cifar10's recipe: what it does not set is cifar10's (the in-house
    generator's fit), what it sets wins; its data are its own."""
    ten, hundred = presets.resolved("cifar10"), presets.resolved("cifar100")
    assert presets.PRESETS["cifar100"].extends == "cifar10"
    assert hundred.stages["fit-generator"] == ten.stages["fit-generator"]
    assert hundred.stages["annotate"]["sharpening"] == 2.3 != ten.stages["annotate"]["sharpening"]
    assert hundred.stages["train"]["model"] == "resnet50"
    assert resolve_stage_config("train", "cifar100").loss.fedlas_ls.alpha == 0.1
    assert resolve_stage_config("train", "cifar10").loss.fedlas_ls.alpha == 0.05
    assert hundred.reads is not ten.reads and hundred.edm_checkpoint != ten.edm_checkpoint
    assert resolve_stage_config("prepare", "cifar100").hf_dataset == "uoft-cs/cifar100"


def _configs(preset: str, data: list[str]) -> dict[str, dict]:
    """Every stage's resolved config of `preset` (finetune needs a run name)."""
    extra = {"finetune": ["run=ce"], "prepare": data}
    return {s: every_field(resolve_stage_config(s, preset, extra.get(s, []))) for s in STAGES}


def test_a_recipe_is_every_value_of_the_recipe_but_the_data_source():
    data = ["data_dir=/data/mine"]
    mine, fashion = _configs(RECIPE, data), _configs("fashion-mnist", data)
    for stage in STAGES:
        differ = {k for k in mine[stage] if mine[stage][k] != fashion[stage][k]}
        assert differ == ({"preset", "source"} if stage == "prepare" else {"preset"}), stage
        assert mine[stage]["preset"] == RECIPE
    assert mine["prepare"]["source"] == "imagefolder" and mine["prepare"]["image_size"] == 28
    assert presets.chain_steps(RECIPE) == presets.chain_steps("fashion-mnist")
    # a recipe never brings its own data source: cifar10's Hub copy is not imagefolder's
    assert resolve_stage_config("prepare", "imagefolder+cifar10").hf_dataset == ""
    # the data's own facts stay the data's: the in-house UNet's images carry digits' license
    assert presets.data_license("digits+fashion-mnist") == presets.data_license("digits")
    assert resolve_stage_config("train", RECIPE).root == Path("runs") / RECIPE


def test_recipe_on_the_command_line_and_its_errors(tmp_path, capsys):
    classes = tmp_path / "flowers.txt"
    classes.write_text("rose\ntulip\n")
    argv = ["prepare", "--preset", str(classes), "--recipe", "digits", "--print-config"]
    assert main(argv) == 0
    config = json.loads(capsys.readouterr().out)
    assert (config["preset"], config["name"]) == ("imagefolder+digits", "flowers+digits")
    assert config["classes_file"] == str(classes) and config["image_size"] == 16
    assert main(["train", "--preset", "imagefolder", "--recipe", "fashon-mnist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown recipe 'fashon-mnist'" in err[0]
    assert "did you mean 'fashion-mnist'" in err[0]
    assert main(["train", "--preset", f"{RECIPE}+digits", "--print-config"]) == 2
    assert "give one recipe" in capsys.readouterr().err


def tiny_imagefolder(root: Path, classes=("cat", "dog", "fox"), per_class=6, size=20) -> Path:
    """`<class>/*.png`: small RGB images (not 28x28: prepare resizes them to the recipe's)."""
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_the_study_on_a_tiny_imagefolder_with_the_fashion_recipe(tmp_path, capsys):
    """`make study CLASSES=imagefolder RECIPE=fashion-mnist SET="prepare.data_dir=DIR"`: the
    fair in-house chain and every study run, resolved as they would run (the study fits a
    diffusion model: too heavy here), then prepare for real on the folder."""
    folder = tiny_imagefolder(tmp_path / "mine")
    out = tmp_path / "runs"
    sets = [f"out={out}", f"prepare.data_dir={folder}"]
    argv = ["study", "--preset", "imagefolder", "--recipe", "fashion-mnist", "--set", *sets]
    assert main([*argv, "--print-config"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["root"] == str(out / RECIPE)
    names = [t["name"] for t in plan["tasks"]]  # real/ first: every other task waits for it
    assert names[0] == "prepare" and "chain" in names and not any(t["done"] for t in plan["tasks"])
    # the chain: the fashion chain's steps with fashion's values, on the folder
    _, root, tasks = pipeline.study.plan.setup(RECIPE, sets)
    assert root == out / RECIPE
    # the study's runs; the generator task runs the chain's steps before generate (below)
    commands = [cmd for task in tasks if task.name != "generator" for cmd in task.commands(RECIPE)]
    assert all(cmd[cmd.index("--preset") + 1] == RECIPE for cmd in commands)
    chain_cmd = next(cmd for cmd in commands if cmd[3] == "chain")
    assert main([*chain_cmd[3:], "--print-config"]) == 0
    steps = json.loads(capsys.readouterr().out)["chain"]
    assert [(s["stage"], s["config"].get("run")) for s in steps] == [
        ("prepare", None),
        ("train", "judge"),
        ("train", "judge-noflip"),
        ("train", "encoder"),
        ("fit-generator", None),
        ("generate", None),
        ("annotate", None),
    ]
    by_stage = {s["stage"]: s["config"] for s in steps}
    prepare = by_stage["prepare"]
    assert (prepare["source"], prepare["data_dir"], prepare["image_size"]) == (
        "imagefolder",
        str(folder),
        28,
    )
    fit = by_stage["fit-generator"]
    assert (fit["unet"], fit["noise"]["prediction_type"], fit["train_limit"]) == (
        "fashion-28",
        "v_prediction",
        5000,
    )
    assert by_stage["annotate"]["encoder"]["name"] == "classifier"
    assert by_stage["annotate"]["judge"] == "judge"
    # every study run (a stage command of a task) resolves to the fashion recipe's values
    seen = set()
    for cmd in commands:
        stage = cmd[3]
        if stage == "chain" or stage in seen:
            continue
        seen.add(stage)
        assert main([*cmd[3:], "--print-config"]) == 0, cmd
        config = json.loads(capsys.readouterr().out)
        assert config["preset"] == RECIPE and Path(config["out"]) == out
        if stage == "train":
            assert (config["model"], config["in_channels"], config["train_limit"]) == (
                "conv-mlp",
                1,
                5000,
            )
    assert {"train", "evaluate"} <= seen
    # prepare, for real: the folder's classes, resized to the recipe's 28x28
    prepare_argv = ["prepare", "--preset", "imagefolder", "--recipe", "fashion-mnist"]
    assert main([*prepare_argv, "--set", f"out={out}", f"data_dir={folder}"]) == 0
    real = out / RECIPE / "real"
    train, test = load_split(real / "train"), load_split(real / "test")
    assert train.class_names == ("cat", "dog", "fox")
    assert tuple(train.images.shape[1:]) == (28, 28, 3)
    assert len(train) + len(load_split(real / "val")) + len(test) == 18
    recorded = json.loads((real / "config.json").read_text())
    assert (recorded["preset"], recorded["source"]) == (RECIPE, "imagefolder")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_generate_runs_the_chain_and_every_target_takes_a_recipe():
    def dry(*words: str) -> list[str]:
        result = subprocess.run(
            ["make", "-n", "-s", "-f", str(REPO / "Makefile"), *words],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        lines = [line for line in result.stdout.splitlines() if " -m pipeline " in line]
        return [line.split(" -m pipeline ", 1)[1].split() for line in lines]

    assert dry("generate")[-1] == dry("chain")[-1]
    assert dry("generate")[-1][:3] == ["chain", "--preset", "digits"]
    study = dry("study", "CLASSES=imagefolder", "RECIPE=fashion-mnist")[-1]
    assert study[:5] == ["study", "--preset", "imagefolder", "--recipe", "fashion-mnist"]
    assert "--recipe" not in dry("train")[-1]
