"""fit-generator on the prepared digits: folder format, loading back, resume == uninterrupted.

A handful of steps at batch 16 on the real digits-tiny UNet: the weights are far from trained,
which is irrelevant to what is checked here (files, identity of weights, determinism).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from core.io import sha256_file
from models.generators import SeriesSpec, load_generator
from models.generators.objective import denoising_loss, denoising_target
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.checkpoints import Checkpointer
from shards.manifest import manifest_digest, read_manifest
from stages.common.loop import make_accelerator
from stages.configs.fit_generator import Config
from stages.fit_generator.stage import WEIGHTS
from stages.fit_generator.training import ACCELERATOR_KWARGS, batch_indices, noise_scheduler

QUICK = [
    "steps=4", "batch_size=16", "checkpoint_every=2", "samples_per_class=2", "sample_steps=2",
    "judge_run=", "fidelity_per_class=1", "guidance_grid=1,2",
]  # fmt: skip


@pytest.fixture
def runs(digits_root, tmp_path):
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    return tmp_path


def test_writes_generator_folder_that_loads_back(runs, capsys):
    folder = run_stage("fit-generator", "digits", [f"out={runs}", *QUICK])
    assert folder == runs / "digits" / "generator"
    manifest = read_manifest(folder)
    assert manifest.kind == "generator" and manifest.shards == () and manifest.num_samples == 0
    assert manifest.class_names == tuple("0123456789")
    assert manifest.upstream == {"real": manifest_digest(runs / "digits" / "real" / "train")}
    info = manifest.info
    assert info["weights_sha256"] == sha256_file(folder / WEIGHTS)
    assert info["class_names"] == list("0123456789") and info["image_size"] == 16
    assert info["train_steps"] == 4 and info["backend"] == "unet"
    config = json.loads((folder / "config.json").read_text())
    assert config["steps"] == 4 and "resume" not in config  # how to start is not what to make
    assert "prediction_type" not in config  # epsilon, the default: left out
    assert not (folder / "checkpoints").exists()  # training state goes once the manifest is there
    # sample grid: one row per class, samples_per_class columns of 16px tiles scaled x4
    with Image.open(folder / "sample_grid.png") as grid:
        assert grid.height == 2 + 10 * (64 + 2)
    # loads back through from_pretrained, as the generate stage does
    gen = load_generator("unet", model=folder, steps=2)
    assert gen.num_classes == 10 and gen.image_size == 16
    images = gen.generate_series([SeriesSpec(0, 3, 8, (1.0, 0.0), seed=1)])
    assert images.shape == (1, 2, 16, 16, 3)
    # complete: a rerun does nothing; another config is refused in one line
    before = sha256_file(folder / WEIGHTS)
    run_stage("fit-generator", "digits", [f"out={runs}", *QUICK, "resume="])
    assert sha256_file(folder / WEIGHTS) == before
    code = main(["fit-generator", "--set", f"out={runs}", *QUICK[1:], "steps=5"])
    errors = [
        e for e in capsys.readouterr().err.splitlines() if e.startswith("semix fit-generator")
    ]
    assert code == 1 and len(errors) == 1 and "differs in: train_steps" in errors[0]


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_the_x0_error_by_min_snr_gamma_for_either_target(prediction_type):
    """Min-SNR-γ means min(SNR, γ)·‖x̂_0 − x_0‖² whatever the UNet predicts: check the loss on ε
    or v targets against that, with x̂_0 recovered from the prediction."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.rand(6, 3, 4, 4, generator=g) * 2 - 1, torch.randn(6, 3, 4, 4, generator=g)
    a_bar = torch.tensor([0.9999, 0.99, 0.8, 0.5, 0.05, 4e-5])[:, None, None, None]
    snr = (a_bar / (1 - a_bar)).flatten()
    x_t = a_bar.sqrt() * x0 + (1 - a_bar).sqrt() * eps
    target = denoising_target(x0, eps, a_bar, prediction_type)
    pred = target + 0.1 * torch.randn(target.shape, generator=g)
    if prediction_type == "v_prediction":
        x0_hat = a_bar.sqrt() * x_t - (1 - a_bar).sqrt() * pred
    else:
        x0_hat = (x_t - (1 - a_bar).sqrt() * pred) / a_bar.sqrt()
    x0_error = (x0_hat - x0).pow(2).flatten(1).mean(1)
    loss = denoising_loss(pred, target, snr, 5.0, prediction_type)
    torch.testing.assert_close(loss, (snr.clamp(max=5.0) * x0_error).mean(), rtol=1e-4, atol=0)
    assert denoising_loss(pred, target, snr, 0.0, prediction_type) == (pred - target).pow(2).mean()


def test_a_v_prediction_generator_records_it_and_samples_with_it(runs):
    folder = run_stage(
        "fit-generator", "digits", [f"out={runs}", *QUICK, "prediction_type=v_prediction"]
    )
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert config["prediction_type"] == "v_prediction"
    assert json.loads((folder / "config.json").read_text())["prediction_type"] == "v_prediction"
    for sampler in ("ddim", "dpmsolver++"):
        gen = load_generator("unet", model=folder, steps=2, sampler=sampler)
        assert gen.scheduler.config.prediction_type == "v_prediction"
        images = gen.generate_series([SeriesSpec(0, 3, 8, (1.0, 0.5, 0.0), seed=1)])
        assert images.shape == (1, 3, 16, 16, 3) and images.float().std() > 0


def test_zero_terminal_snr_ends_the_schedule_in_pure_noise_and_the_sampler_follows(runs):
    folder = run_stage(
        "fit-generator", "digits",
        [f"out={runs}", *QUICK, "prediction_type=v_prediction", "zero_terminal_snr=true"],
    )  # fmt: skip
    assert json.loads((folder / "config.json").read_text())["zero_terminal_snr"] is True
    for sampler in ("ddim", "dpmsolver++"):
        gen = load_generator("unet", model=folder, steps=2, sampler=sampler)
        assert gen.scheduler.config.rescale_betas_zero_snr is True
        assert float(gen.scheduler.alphas_cumprod[-1]) < 1e-7  # DPM-Solver keeps 2^-24 (no inf)
        images = gen.generate_series([SeriesSpec(0, 3, 8, (1.0, 0.5, 0.0), seed=1)])
        assert torch.isfinite(images.float()).all() and images.float().std() > 0
    plain = noise_scheduler(Config(prediction_type="v_prediction"))
    assert float(plain.alphas_cumprod[-1]) > 0  # off: the linear schedule's ᾱ_T ≈ 4e-5
    assert "zero_terminal_snr" not in Config().recorded()  # off: existing fits keep their bytes


def test_zero_terminal_snr_needs_v_prediction(runs, capsys):
    assert main(["fit-generator", "--preset", "digits", "--set", f"out={runs}",
                 "noise.zero_terminal_snr=true", "noise.prediction_type=epsilon"]) != 0  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert "noise.zero_terminal_snr=true needs noise.prediction_type=v_prediction" in err[-1]


def test_saved_weights_are_the_ema(runs):
    """ema_decay=0 saves the raw weights; the default EMA of the same run saves other ones."""
    for name in ("raw", "ema"):
        shutil.copytree(runs / "digits" / "real", runs / name / "real")
    quick = ["steps=2", "batch_size=16", "samples_per_class=1", "sample_steps=1", "judge_run="]
    quick += ["fidelity.per_class=1", "fidelity.guidance_grid=1"]  # its check: not compared
    raw = run_stage("fit-generator", "digits", [f"out={runs}", "name=raw", *quick, "ema_decay=0"])
    ema = run_stage("fit-generator", "digits", [f"out={runs}", "name=ema", *quick])
    w_raw, w_ema = load_file(raw / WEIGHTS), load_file(ema / WEIGHTS)
    assert w_raw.keys() == w_ema.keys()
    assert not all(torch.equal(w_raw[k], w_ema[k]) for k in w_raw)


def test_resume_gives_the_same_weights(runs, monkeypatch):
    (runs / "b").mkdir()
    shutil.copytree(runs / "digits", runs / "b" / "digits")
    steps = ["steps=6", *QUICK[1:], "fidelity_every=3"]  # the point at step 3 is in checkpoint_1
    straight = run_stage("fit-generator", "digits", [f"out={runs}", *steps])
    # "kill" run b right after its second checkpoint (step 4 of 6)
    saved = []
    save = Checkpointer.save

    def save_then_die(self, *args):
        save(self, *args)
        saved.append(1)
        if len(saved) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_stage("fit-generator", "digits", [f"out={runs / 'b'}", *steps])
    folder = runs / "b" / "digits" / "generator"
    ckpts = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert ckpts == ["checkpoint_0", "checkpoint_1"] and not (folder / "manifest.json").exists()
    monkeypatch.setattr(Checkpointer, "save", save)
    resumed = run_stage("fit-generator", "digits", [f"out={runs / 'b'}", *steps])
    for name in (str(WEIGHTS), "sample_grid.png", "manifest.json", "fidelity.json"):
        assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name
    assert [p["step"] for p in json.loads((resumed / "fidelity.json").read_text())["curve"]] == [
        3,
        6,
    ]


def test_fidelity_curve_chooses_the_guidance_that_generate_uses(runs, capsys):
    """label dropout -> a null row; fidelity at every `fidelity_every` steps and at the end for
    each w; the best w of the last point is recorded and is generate's guidance=auto; an
    explicit guidance overrides it; without dropout only w = 1 exists."""
    sets = [f"out={runs}", *QUICK, "steps=4", "fidelity_every=2", "guidance_grid=1,2,3"]
    folder = run_stage("fit-generator", "digits", sets)
    info = read_manifest(folder).info
    fidelity = json.loads((folder / "fidelity.json").read_text())
    assert [p["step"] for p in fidelity["curve"]] == [2, 4]
    last = fidelity["curve"][-1]["guidance"]
    assert sorted(last) == ["1", "2", "3"] and all(
        list(v) == ["linear probe"] for v in last.values()
    )
    stats = last["1"]["linear probe"]
    assert stats["n_images"] == 10 and sum(c["n"] for c in stats["per_class"].values()) == 10
    best = max(sorted(last, key=float), key=lambda w: last[w]["linear probe"]["accuracy"])
    assert info["null_class"] is True and info["guidance"] == float(best) == fidelity["guidance"]
    assert info["fidelity"] == {"linear probe": round(last[best]["linear probe"]["accuracy"], 2)}
    assert (folder / "fidelity.png").stat().st_size > 0
    assert load_generator("unet", model=folder, steps=1).num_classes == 10  # ∅ is not a class
    gen_sets = [f"out={runs}", "limit=1", "steps=2", "preview_series=1"]
    series = run_stage("generate", "digits", gen_sets)
    assert read_manifest(series).info["generator"]["guidance"] == info["guidance"]
    shutil.rmtree(series)
    series = run_stage("generate", "digits", [*gen_sets, "guidance=2.5"])
    assert read_manifest(series).info["generator"]["guidance"] == 2.5

    (runs / "plain").mkdir()
    shutil.copytree(runs / "digits" / "real", runs / "plain" / "digits" / "real")
    plain = run_stage(
        "fit-generator", "digits", [f"out={runs / 'plain'}", *QUICK, "label_dropout=0"]
    )
    info = read_manifest(plain).info
    assert info["null_class"] is False and info["guidance"] == 1.0
    assert list(json.loads((plain / "fidelity.json").read_text())["curve"][-1]["guidance"]) == ["1"]
    assert load_generator("unet", model=plain, steps=1).unet.config.num_class_embeds == 10
    code = main(["generate", "--set", f"out={runs / 'plain'}", "limit=1", "guidance=2"])
    err = [e for e in capsys.readouterr().err.splitlines() if e.startswith("semix generate")]
    assert code == 1 and len(err) == 1 and "no null condition" in err[0], err
    assert not (runs / "plain" / "digits" / "series").exists()


def test_batches_are_epoch_permutations():
    n, batch = 10, 4
    seen = torch.cat([batch_indices(n, 0, s, batch, r, 2) for s in range(5) for r in range(2)])
    # global positions 0..39 cover 4 epochs, each a permutation of range(10)
    for e in range(4):
        assert sorted(seen[e * n : (e + 1) * n].tolist()) == list(range(n))
    assert torch.equal(batch_indices(n, 0, 3, batch, 1, 2), seen[7 * batch : 8 * batch])
    assert not torch.equal(batch_indices(n, 1, 0, batch, 0, 1), batch_indices(n, 0, 0, batch, 0, 1))


# limit=1: the one complete checkpoint must survive until the new one is complete; a save that
# pruned it first would leave, killed while deleting, a folder with its marker but no model.
@pytest.mark.parametrize("limit", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_kill_at_every_point_of_a_checkpoint_save_resumes(runs, monkeypatch, limit):
    """Kill fit-generator before each file-system change of its third checkpoint save (one that
    prunes an older checkpoint), rerun it: every rerun ends with the uninterrupted weights."""
    from conftest import Killed, KillPoints

    quick = ["steps=4", "batch_size=8", "checkpoint_every=1", "samples_per_class=1", "judge_run="]
    quick += ["sample_steps=1", f"checkpoints_total_limit={limit}"]
    quick += ["fidelity.per_class=1", "fidelity.guidance_grid=1"]  # its check: not compared
    # ~40 fits (a killed one and its rerun per point): each fits on, and fits its linear-probe
    # judge on, 64 images instead of 1,294; what a save writes does not depend on how many
    quick += ["train_limit=64"]
    shutil.copytree(runs / "digits" / "real", runs / "ref" / "real")
    ref = run_stage("fit-generator", "digits", [f"out={runs}", "name=ref", *quick])
    points = KillPoints(monkeypatch, runs)
    saves = []
    save = Checkpointer.save

    def third_save_armed(self, *args):
        saves.append(1)
        points.armed = len(saves) == 3
        try:
            save(self, *args)
        finally:
            points.armed = False

    monkeypatch.setattr(Checkpointer, "save", third_save_armed)
    shutil.copytree(runs / "digits" / "real", runs / "count" / "real")
    run_stage("fit-generator", "digits", [f"out={runs}", "name=count", *quick])
    changes = list(points.changes)
    assert any("rmtree" in c or "rmdir" in c for c in changes), changes  # it prunes
    failures = {}
    for k, change in enumerate(changes):
        saves.clear()
        points.changes, points.kill_at = [], k
        name = f"kill{k}"
        shutil.copytree(runs / "digits" / "real", runs / name / "real")
        with pytest.raises(Killed):
            run_stage("fit-generator", "digits", [f"out={runs}", f"name={name}", *quick])
        points.kill_at = None
        try:
            out = run_stage("fit-generator", "digits", [f"out={runs}", f"name={name}", *quick])
        except Exception as e:  # collected: the assertion names every failure
            failures[change] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        if (out / WEIGHTS).read_bytes() != (ref / WEIGHTS).read_bytes():
            failures[change] = "other weights"
    assert not failures, f"{len(failures)} of {len(changes)} kill points: {failures}"


def test_the_lr_schedule_counts_optimiser_steps_on_any_number_of_processes(monkeypatch):
    """With 2 processes accelerate would step a prepared scheduler twice per optimiser step;
    the stage's accelerator steps it once, so warm-up and cosine keep their length."""
    import accelerate.scheduler
    from accelerate.state import AcceleratorState

    from core.tracking import Tracking

    tracking = Tracking((), Path("."), Path("."))
    accelerator = make_accelerator(
        "no", cpu=True, **ACCELERATOR_KWARGS, **tracking.accelerator_kwargs()
    )
    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    _, opt, sched = accelerator.prepare(layer, opt, sched)

    class TwoProcesses:
        num_processes = 2

    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", TwoProcesses)
    for _ in range(3):
        opt.step()
        sched.step()
    assert sched.scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == 0.25
    assert AcceleratorState is not TwoProcesses
