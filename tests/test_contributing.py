"""docs/contributing.md's checklists, done by a stranger: a loss and a preset added from a module
of one's own (in tmp_path, outside the repository), run through the CLI with SEMIX_PLUGINS, and
no file of semix changed (pipeline/plugins.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_many_with_plugins, run_with_plugins, semix_sources, write_plugins
from safetensors.torch import load_file

from pipeline.registry import resolve_stage_config
from shards.writer import check_config

# SGD without weight decay or clipping: a loss scaled by 2 at half the lr takes the same steps
TINY = ["epochs=1", "train_limit=192", "batch_size=64", "weight_decay=0", "clip_norm=0"]

TOY_LOSS = '''
"""A loss of one's own: 2^k x cross-entropy, its parameter a frozen dataclass."""
from dataclasses import dataclass

from torch import nn
from torch.nn import functional as F

from core.parts import Params, param
from models.objectives import criterion, register_loss


class ScaledCE(nn.Module):
    @dataclass(frozen=True)
    class Params(Params):
        scale: float = param(1.0, low=0.0, doc="the loss is scale x CE")

    def __init__(self, num_classes, params):
        super().__init__()
        self.scale = params.scale

    def forward(self, logits, labels):
        return self.scale * F.cross_entropy(logits, labels)


register_loss("scaled-ce", ScaledCE.Params, criterion(ScaledCE))
'''

TOY_PRESET = '''
"""A preset of one's own: digits' data and recipe, a shorter train run."""
from stages.presets import register_preset
from stages.presets.base import Preset

register_preset(
    Preset(name="digits-quick", extends="digits", stages={"train": dict(epochs=3, lr=0.02)})
)
'''


@pytest.fixture
def plugins(tmp_path) -> Path:
    return write_plugins(tmp_path / "mine", toy_loss=TOY_LOSS, toy_preset=TOY_PRESET)


def semix(plugins: Path, modules: str, *args: str) -> subprocess.CompletedProcess:
    return run_with_plugins(plugins, modules, [sys.executable, "-m", "pipeline", *args])


def test_a_loss_from_your_own_module_trains_through_the_cli(plugins, digits_root, tmp_path):
    before = semix_sources()
    out = tmp_path / "runs"
    shutil.copytree(digits_root / "real", out / "digits" / "real")

    def train(*sets: str) -> list[str]:
        return ["train", "--preset", "digits", "--set", f"out={out}", *TINY, *sets]

    def trained(run: subprocess.CompletedProcess) -> Path:
        assert run.returncode == 0, run.stderr
        return Path(run.stdout.strip().split(" -> ")[-1])

    # (1, 2 and 4 in one process: calls in turn, nothing done between them that they read)
    toy_run, ce_run, fields_run = run_many_with_plugins(
        plugins,
        "toy_loss",
        [
            train("run=toy", "loss.name=scaled-ce", "loss.scale=2", "lr=0.05"),
            train("run=ce", "loss=ce", "lr=0.1"),
            ["train", "--fields"],
        ],
    )
    # 1. The loss trains, its parameter set the nested way; config.json and metrics record it.
    toy = trained(toy_run)
    config = json.loads((toy / "config.json").read_text())
    assert (config["loss"], config["scaled_ce_scale"]) == ("scaled-ce", 2.0)
    metrics = json.loads((toy / "metrics.json").read_text())
    assert metrics["train"]["loss_params"] == {"scale": 2.0}
    # 2. It is the objective the run optimised: 2 x CE at lr 0.05 takes exactly the SGD steps of
    #    CE at lr 0.1 (momentum, no weight decay, no clipping; x2 and /2 are exact in floats).
    ce = trained(ce_run)
    toy_w, ce_w = load_file(toy / "model.safetensors"), load_file(ce / "model.safetensors")
    assert toy_w.keys() == ce_w.keys() and all(toy_w[k].equal(ce_w[k]) for k in ce_w)
    # 3. The plugin changes no other run's identity: ce's config.json matches the config semix
    #    records without it (this process loaded no plugin), as runs recorded before do.
    plain = resolve_stage_config("train", "digits", [f"out={out}", *TINY, "run=ce", "lr=0.1"])
    assert check_config(ce, plain.recorded(), fix="")
    assert "scaled_ce" not in (ce / "config.json").read_text()
    # 4. --fields and --help show it like any loss.
    fields = fields_run.stdout
    assert any(line.split()[:2] == ["loss.scaled_ce.scale", "1.0"] for line in fields.splitlines())
    assert "scaled-ce" in next(line for line in fields.splitlines() if line.split()[:1] == ["loss"])
    assert semix_sources() == before


def test_a_preset_from_your_own_module_extends_one_and_resolves_through_the_cli(plugins):
    before = semix_sources()
    # (the three toy_preset calls in one process: calls in turn, nothing done between them)
    run, prepare_run, listing = run_many_with_plugins(
        plugins,
        "toy_preset",
        [
            ["train", "--preset", "digits-quick", "--print-config"],
            ["prepare", "--preset", "digits-quick", "--print-config"],
            ["--help"],
        ],
    )
    assert run.returncode == 0, run.stderr
    config = json.loads(run.stdout)
    digits = resolve_stage_config("train", "digits")
    assert (config["preset"], config["epochs"], config["optim"]["lr"]) == ("digits-quick", 3, 0.02)
    assert (config["model"], config["batch_size"]) == (digits.model, digits.batch_size)
    prepare = json.loads(prepare_run.stdout)
    assert (prepare["source"], prepare["image_size"]) == ("digits", 16)  # digits' data
    assert "digits-quick" in listing.stdout
    both = semix(plugins, "toy_loss,toy_preset", "train", "--preset", "digits-quick",
                 "--set", "loss.name=scaled-ce", "--print-config")  # fmt: skip
    assert json.loads(both.stdout)["loss"]["name"] == "scaled-ce"
    assert semix_sources() == before


def test_a_missing_plugin_is_refused_in_one_line(plugins):
    run = semix(plugins, "toy_lost", "train", "--fields")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "SEMIX_PLUGINS: no module 'toy_lost'" in run.stderr
