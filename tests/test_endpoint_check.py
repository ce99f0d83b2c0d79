"""generate's endpoint check (endpoint_check=redraw|drop): series whose pure images a judge
rejects are drawn again from a seeded fresh noise or dropped; deterministic and resumable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import stages.generate.stage as generate
from core.seeding import derive_seed
from models.generators import MixSpec, SeriesSpec
from pipeline.registry import run_stage
from shards.manifest import read_manifest
from shards.reader import iter_folder
from stages.common.fidelity import Judge
from stages.generate.check import EndpointCheck, endpoints, passing

CONFIG = ["alphas=3", "steps=2", "limit=12", "series_per_shard=3", "endpoint_judge=fake"]


def pixel_judge() -> Judge:
    """Predicts the class written into pixel (0, 0) of the red channel, modulo 10."""
    return Judge("pixel", lambda images: images[:, 0, 0, 0].long() % 10, 100.0)


def test_endpoints_are_the_pure_images():
    assert endpoints(SeriesSpec(0, 3, 8, (0.0, 0.5, 1.0), 1)) == [(0, 8), (2, 3)]
    weights = ((1.0, 0.0, 0.0), (0.5, 0.5, 0.0), (0.0, 0.0, 1.0), (0.0, 1.0, 0.0))
    assert endpoints(MixSpec(0, (4, 5, 6), weights, 1)) == [(0, 4), (2, 6), (3, 5)]


def test_passing_needs_every_pure_image_in_its_class():
    specs = [SeriesSpec(i, 1, 2, (0.0, 0.5, 1.0), i) for i in range(3)]
    images = torch.zeros(3, 3, 4, 4, 3, dtype=torch.uint8)
    images[:, 0, 0, 0, 0] = 2  # α = 0: class b = 2, right for every series
    images[:, 2, 0, 0, 0] = torch.tensor([1, 7, 1])  # α = 1: class a = 1, wrong for series 1
    images[2, 0, 0, 0, 0] = 5  # and series 2's α = 0 image is wrong
    assert passing(pixel_judge(), specs, images) == [True, False, False]


def test_redraw_replaces_failing_series_with_seeded_fresh_noise():
    """A sampler whose images pass exactly when their seed is even: every redrawn series carries
    derive_seed(seed, "redraw", try) of the first even try; none left after 3 tries is dropped."""

    def sample(specs):
        images = torch.zeros(len(specs), 3, 4, 4, 3, dtype=torch.uint8)
        for i, s in enumerate(specs):
            ok = s.seed % 2 == 0
            images[i, 0, 0, 0, 0] = s.class_b if ok else s.class_b + 1
            images[i, 2, 0, 0, 0] = s.class_a
        return images

    specs = [SeriesSpec(i, 1, 2, (0.0, 0.5, 1.0), 100 + i) for i in range(8)]
    check = EndpointCheck("redraw", pixel_judge(), tries=3)
    kept, images, counts = check(sample, specs, sample(specs))
    assert counts["series"] == 8 and counts["passed"] == 4  # seeds 100, 102, 104, 106
    for spec in kept:
        assert spec.seed % 2 == 0
        if spec.seed != 100 + spec.series_id:
            tries = [derive_seed(100 + spec.series_id, "redraw", t) for t in (1, 2, 3)]
            first_even = next(s for s in tries if s % 2 == 0)
            assert spec.seed == first_even
    assert counts["redrawn"] + counts["dropped"] == 4 and len(kept) == 8 - counts["dropped"]
    assert torch.equal(images, sample(kept))
    drop = EndpointCheck("drop", pixel_judge(), tries=3)
    kept, _, counts = drop(sample, specs, sample(specs))
    assert [s.series_id for s in kept] == [0, 2, 4, 6] and counts["extra_draws"] == 0


@pytest.fixture
def runs(generator_root, tmp_path, monkeypatch) -> Path:
    """digits/real + a random generator (a copy of conftest's generator_root); the judge passes
    a series when the sum of its pure images' pixels is not a multiple of 3 (~2/3 of them),
    whatever model made them."""
    shutil.copytree(generator_root, tmp_path / "digits")
    monkeypatch.setattr(generate, "cnn_judge", lambda *a, **k: pixel_judge())

    def by_pixel_sum(judge, specs, images):
        return [int(images[i, [0, -1]].long().sum()) % 3 != 0 for i in range(len(specs))]

    monkeypatch.setattr("stages.generate.check.passing", by_pixel_sum)
    return tmp_path


@pytest.mark.parametrize("mode", ["redraw", "drop"])
def test_checked_series_are_deterministic_resumable_and_counted(runs, mode):
    sets = [f"out={runs}", *CONFIG, f"endpoint_check={mode}"]
    out = run_stage("generate", "digits", sets)
    manifest = read_manifest(out)
    counts = manifest.info["endpoint_check"]
    present = {s["meta"]["series"] for s in iter_folder(out)}
    assert counts["mode"] == mode and counts["series"] == 12
    assert counts["dropped"] == 12 - len(present)
    assert counts["passed"] + counts["redrawn"] == len(present) and counts["passed"] < 12
    if mode == "drop":
        assert counts["redrawn"] == 0 and counts["extra_draws"] == 0 and counts["dropped"] > 0
    else:  # ~1/3 fail their first draw; a fresh noise passes most of them
        assert counts["redrawn"] > 0 and counts["extra_draws"] >= counts["redrawn"]
    config = json.loads((out / "config.json").read_text())
    assert config["endpoint_check"] == mode and config["endpoint_tries"] == 3
    # kill-equivalent: a shard and its completion record gone; the rerun rewrites them equal
    before = {p.name: p.read_bytes() for p in out.glob("series-*.tar")}
    (out / "manifest.json").unlink()
    (out / "series-000001.tar").unlink()
    for record in (out / ".done").glob("series-000001*"):
        record.unlink()
    run_stage("generate", "digits", sets)
    assert {p.name: p.read_bytes() for p in out.glob("series-*.tar")} == before
    assert read_manifest(out).info["endpoint_check"] == counts


def test_off_writes_the_config_as_before(runs):
    out = run_stage("generate", "digits", [f"out={runs}", *CONFIG])
    config = json.loads((out / "config.json").read_text())
    assert not any(k.startswith("endpoint") for k in config)
    assert "endpoint_check" not in read_manifest(out).info
