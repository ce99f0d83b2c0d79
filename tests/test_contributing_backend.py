"""docs/contributing.md's "Add a generator backend", done by a stranger: a backend written in a
module of one's own (in tmp_path, outside the repository), loaded with SEMIX_PLUGINS, run through
the generate CLI with its parameters set as `backend.<param>=`, and no file of semix changed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_many_with_plugins, run_with_plugins, semix_sources, write_plugins

from shards.manifest import read_manifest
from shards.reader import load_split

# 3 class pairs x 1 series x 3 alphas = 9 images
TINY = ["pairs=3", "series_per_pair=1", "alphas=3"]

TOY_BACKEND = '''
"""A backend of one's own: an image is its classes' colours blended by the series' weights, plus
the series' noise as grain (the same grain at every alpha of a series)."""
from dataclasses import dataclass
from typing import Literal

import torch

from core.parts import Params, param
from models.generators import register_backend
from models.generators.base import Generator


def colours(palette, n):
    """[n, 3] in [-1, 1]: class c's colour."""
    ramp = torch.linspace(-0.6, 0.6, n)
    side = torch.full_like(ramp, 0.6 if palette == "warm" else -0.6)
    return torch.stack([side, ramp, -side], 1)


class TwoColour(Generator):
    backend = "two-colour"

    @dataclass(frozen=True)
    class Params(Params):
        palette: Literal["warm", "cool"] = param("warm", doc="the classes' colours")
        grain: float = param(0.05, low=0.01, high=0.5, doc="how much of the noise shows")

    def __init__(self, model, *, class_names, image_size, palette="warm", grain=0.05,
                 lazy=False, **shared):
        super().__init__(model or "palette", **shared)  # it reads no model
        self.num_classes, self.image_size, self.guidance = len(class_names), image_size, 1.0
        self.palette, self.grain = palette, grain

    def _load(self):
        self.table = colours(self.palette, self.num_classes).to(self.device)

    @property
    def noise_shape(self):
        return (3, self.image_size, self.image_size)

    def condition(self, classes, weights):
        mixed = weights[:, 0, None] * self.table[classes[:, 0]]
        for i in range(1, classes.shape[1]):
            mixed = mixed + weights[:, i, None] * self.table[classes[:, i]]
        return mixed

    def sample(self, noise, cond):
        return cond[:, :, None, None] + self.grain * noise

    def metadata(self):
        return super().metadata() | {"palette": self.palette, "grain": self.grain}


register_backend("two-colour", TwoColour, needs_model=False)
'''


@pytest.fixture
def plugin(tmp_path) -> Path:
    return write_plugins(tmp_path / "mine", toy_backend=TOY_BACKEND)


def generate(plugin: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pipeline", "generate", "--preset", "digits", *args]
    return run_with_plugins(plugin, "toy_backend", argv)


def expected_colour(palette: str, classes: list[int], alpha: float) -> torch.Tensor:
    """The blend the toy paints, in uint8 units (what the grain sits on)."""
    table = torch.linspace(-0.6, 0.6, 10)
    side = 0.6 if palette == "warm" else -0.6
    a, b = (torch.tensor([side, table[c], -side]) for c in classes)
    return ((alpha * a + (1 - alpha) * b) / 2 + 0.5) * 255


def test_a_backend_from_your_own_module_generates_through_the_cli(plugin, digits_root, tmp_path):
    before = semix_sources()
    out = tmp_path / "runs"
    shutil.copytree(digits_root / "real", out / "digits" / "real")

    # 1. The backend generates, its parameter set the nested way; the series are written.
    run = generate(plugin, "--set", f"out={out}", "backend=two-colour", "backend.palette=cool",
                   *TINY)  # fmt: skip
    assert run.returncode == 0, run.stderr
    series = out / "digits" / "series"
    manifest = read_manifest(series)
    assert manifest.kind == "series" and manifest.num_samples == 9
    assert (series / "preview.png").is_file()
    # 2. config.json records the backend and its parameter off its default (grain is at its
    #    default: not recorded, so adding a backend changes no run's identity); the manifest
    #    and every sample record the generator's own identity (its metadata()).
    config = json.loads((series / "config.json").read_text())
    assert (config["backend"], config["two_colour_palette"]) == ("two-colour", "cool")
    assert "two_colour_grain" not in config
    ident = manifest.info["generator"]
    assert (ident["backend"], ident["model_id"]) == ("two-colour", "palette")
    assert (ident["palette"], ident["grain"]) == ("cool", 0.05)
    # 3. The images are what the backend paints: the classes' colours blended by alpha, and
    #    one grain per series (the shared noise of a CSM series).
    split = load_split(series)
    assert split.images.shape == (9, 16, 16, 3)
    grain: dict[int, list[torch.Tensor]] = {}
    for image, meta in zip(split.images, split.meta):
        assert meta["generator"] == "two-colour:palette"
        colour = expected_colour("cool", meta["classes"], meta["alpha"])
        rest = image.float() - colour
        assert rest.mean(dim=(0, 1)).abs().max() < 2  # the blend, under zero-mean grain
        grain.setdefault(meta["series"], []).append(rest)
    assert len(grain) == 3
    for rests in grain.values():  # the same noise at every alpha, up to rounding
        assert all((r - rests[0]).abs().max() <= 1.01 for r in rests)
    first, second = (rests[0] for rests in list(grain.values())[:2])
    assert (first - second).abs().max() > 5  # another series, another noise
    assert semix_sources() == before


def test_its_parameters_are_leaves_of_the_backend_section(plugin):
    """The flat name (config.json's) and the nested ones set the same leaf,
    `backend.two_colour.grain`; --fields lists the leaves with their choices; a bad value is
    refused in one line, naming the leaf by its path."""
    # (the five calls in one process: calls in turn, nothing done between them; each call gets
    # a fresh warnings state, so the rename note is said as a process of its own would say it)
    flat, nested, named, fields_run, bad = run_many_with_plugins(
        plugin,
        "toy_backend",
        [
            ["generate", "--preset", "digits", *args]
            for args in (
                ["--set", "backend=two-colour", "two_colour_grain=0.1", "--print-config"],
                ["--set", "backend.name=two-colour", "backend.grain=0.1", "--print-config"],
                ["--set", "backend=two-colour", "backend.two-colour.grain=0.1", "--print-config"],
                ["--fields"],
                ["--set", "backend=two-colour", "backend.palette=green", "--print-config"],
            )
        ],
    )
    assert flat.returncode == 0, flat.stderr
    assert json.loads(flat.stdout) == json.loads(nested.stdout) == json.loads(named.stdout)
    backend = json.loads(flat.stdout)["backend"]
    assert (backend["name"], backend["two_colour"]["grain"]) == ("two-colour", 0.1)
    assert "two_colour_grain is now backend.two_colour.grain" in flat.stderr  # said once
    assert "is now" not in nested.stderr
    fields = fields_run.stdout.splitlines()
    (palette,) = [line for line in fields if line.split()[:1] == ["backend.two_colour.palette"]]
    assert palette.split()[1] == "warm" and "cool" in palette
    (backend_row,) = [line for line in fields if line.split()[:1] == ["backend"]]
    assert "two-colour" in backend_row
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "backend.two_colour.palette='green'" in bad.stderr
