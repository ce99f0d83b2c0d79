"""fit-generator on a finished fit whose check grid changed (stages/fit_generator/recheck.py): the
last fidelity point is checked again on the saved weights, w and x̂₀ clipping are chosen by the
same rule, and generate samples with the choice; anything else that changed is refused as
before."""

from __future__ import annotations

import json
import shutil

import pytest
from test_fit_generator import QUICK

from core.io import sha256_file
from models.generators import load_generator
from pipeline.registry import run_stage
from shards.manifest import ShardError, read_manifest
from stages.common.fidelity import FidelityCheck, Judge


@pytest.fixture
def runs(digits_root, tmp_path):
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    return tmp_path


def test_a_finished_fit_is_rechecked_not_refitted_when_only_its_check_grid_changes(runs):
    sets = [f"out={runs}", *QUICK, "fidelity_every=2"]
    folder = run_stage("fit-generator", "digits", sets)
    weights = sha256_file(folder / "unet" / "diffusion_pytorch_model.safetensors")
    first = json.loads((folder / "fidelity.json").read_text())
    assert "clip" not in first["curve"][-1] and "clip_sample" not in read_manifest(folder).info

    wider = [*sets, "guidance_grid=1,2,3", "clip_choice=true"]
    assert run_stage("fit-generator", "digits", wider) == folder
    fidelity = json.loads((folder / "fidelity.json").read_text())
    assert fidelity["curve"][0] == first["curve"][0]  # the earlier point stays as checked
    last = fidelity["curve"][-1]
    assert last["step"] == 4 and set(last["clip"]) == {"on", "off"}
    assert sorted(last["clip"]["off"], key=float) == ["1", "2", "3"]
    assert last["clip_saved"] == "on" and last["guidance"] == last["clip"]["on"]
    cells = {
        (c, w): by_judge["linear probe"]["accuracy"]
        for c, by_w in last["clip"].items()
        for w, by_judge in by_w.items()
    }
    clip, w = min(cells, key=lambda k: (-cells[k], k[0] != "on", float(k[1])))
    info = read_manifest(folder).info
    assert info["guidance"] == float(w) == fidelity["guidance"]
    assert info["clip_sample"] is (clip == "on") is fidelity["clip_sample"]
    assert sha256_file(folder / "unet" / "diffusion_pytorch_model.safetensors") == weights
    config = json.loads((folder / "config.json").read_text())
    assert config["clip_choice"] is True and config["guidance_grid"] == [1.0, 2.0, 3.0]
    assert sorted(p.name for p in folder.parent.iterdir() if "generator" in p.name) == [
        "generator"
    ]  # no .recheck / .old left behind

    manifest = (folder / "manifest.json").read_bytes()  # the same config again: nothing to do
    run_stage("fit-generator", "digits", wider)
    assert (folder / "manifest.json").read_bytes() == manifest
    series = run_stage("generate", "digits", [f"out={runs}", "limit=1", "steps=2"])
    assert read_manifest(series).info["generator"]["clip_sample"] is info["clip_sample"]
    with pytest.raises(ShardError, match="steps"):  # the weights would change: refused
        run_stage("fit-generator", "digits", [*wider, "steps=6"])


def test_the_clipping_override_reaches_the_sampler_and_the_metadata(runs):
    folder = run_stage("fit-generator", "digits", [f"out={runs}", *QUICK])
    saved = load_generator("unet", model=folder, steps=1)
    assert saved.scheduler.config.clip_sample is True and "clip_sample" not in saved.metadata()
    off = load_generator("unet", model=folder, steps=1, clip_sample=False)
    assert off.scheduler.config.clip_sample is False and off.metadata()["clip_sample"] is False
    assert off.call_settings(None, True)["scheduler"].config.clip_sample is True
    assert off.scheduler.config.clip_sample is False  # a call's clipping leaves it as it was


def test_the_clipping_override_reaches_a_live_fits_sampler_too():
    """fit-generator checks the EMA weights in memory, with the training scheduler's config
    object: an override must reach that sampler as it does one read from a folder, for the
    call that asks for it only (the generator's own sampler and w stay as they were)."""
    import torch

    from models.generators import SeriesSpec, UNetGenerator, unet_from_preset
    from stages.configs.fit_generator import Config
    from stages.fit_generator.training import noise_scheduler

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = unet_from_preset("digits-tiny", 10, null_class=True)
    config = noise_scheduler(Config(prediction_type="v_prediction")).config
    gen = UNetGenerator.from_model(unet.eval(), config, steps=3, guidance=3.0)
    spec = [SeriesSpec(0, 1, 1, (1.0,), seed=1)]
    on, sampler = gen.generate_series(spec), gen.scheduler
    off = gen.call_settings(None, False)["scheduler"]
    assert off.config.clip_sample is False
    assert off.config.timestep_spacing == "trailing"  # the config's values, kept
    unclipped = gen.generate_series(spec, clip_sample=False)
    assert not torch.equal(unclipped, on)  # random weights: x̂₀ leaves [-1, 1]
    assert gen.scheduler is sampler and gen.scheduler.config.clip_sample is True
    assert gen.clip_sample is None and gen.guidance == 3.0
    assert torch.equal(gen.generate_series(spec), on)
    assert torch.equal(gen.generate_series(spec, clip_sample=True), on)  # the saved setting
    built = UNetGenerator.from_model(unet, config, steps=3, guidance=3.0, clip_sample=False)
    assert torch.equal(built.generate_series(spec), unclipped)  # per call = built with it


def _point(on: dict[str, float], off: dict[str, float]) -> dict:
    def cells(acc):
        return {w: {"j": {"accuracy": a}} for w, a in acc.items()}

    return {"step": 1, "guidance": cells(on), "clip": {"on": cells(on), "off": cells(off)},
            "clip_saved": "on"}  # fmt: skip


@pytest.mark.parametrize(
    "on, off, want",
    [
        ({"1": 80.0, "2": 90.0}, {"1": 85.0, "2": 95.0}, (2.0, False)),  # off is better
        ({"1": 80.0, "2": 95.0}, {"1": 85.0, "2": 95.0}, (2.0, True)),  # tie: the saved setting
        ({"1": 95.0, "2": 95.0}, {"1": 90.0, "2": 90.0}, (1.0, True)),  # tie: the smaller w
    ],
)
def test_choose_takes_the_judges_best_cell_with_the_documented_ties(on, off, want):
    check = FidelityCheck([Judge("j", lambda x: x, 90.0)], (1.0, 2.0), ("a",), 0, 1, True)
    w, clip, summary = check.choose([_point(on, off)])
    assert (w, clip) == want and summary == {"j": max(max(on.values()), max(off.values()))}
