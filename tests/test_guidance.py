"""Classifier-free guidance of the unet backend on tiny random-weight UNets.

A UNet fitted with label dropout has one more class-table row, the null condition ∅. What must
hold: guidance w = 1 samples exactly as a UNet without that row (byte-identical), w ≠ 1 is the
guided ε of an independent step-by-step computation, series keep their shared noise and their
independence of the batch size, a call's own w samples as the generator built with it, and a
UNet without ∅ refuses w ≠ 1 in one line.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from models.generators import SeriesSpec, build_unet, load_generator, save_unet
from models.generators.unet import NULL_CLASS

STEPS = 3
SPECS = [SeriesSpec(0, 0, 2, (1.0, 0.5, 0.0), seed=11), SeriesSpec(1, 1, 0, (1.0, 0.3, 0.0), 12)]


@pytest.fixture(scope="module")
def unets(tmp_path_factory):
    """The same random weights twice: with the null row (4 rows for 3 classes) and without it."""
    root = tmp_path_factory.mktemp("guidance")
    torch.manual_seed(0)
    null = build_unet(
        16, num_classes=3, channels=(16, 32), attention=(False, True), null_class=True
    )
    plain = build_unet(16, num_classes=3, channels=(16, 32), attention=(False, True))
    state = null.state_dict()
    state["class_embedding.weight"] = state["class_embedding.weight"][:3]
    plain.load_state_dict(state)
    for name, unet in (("null", null), ("plain", plain)):
        save_unet(root / name, unet, DDPMScheduler(timestep_spacing="trailing"))
    return root


def test_the_null_row_is_recorded_in_the_model_config(unets):
    gen = load_generator("unet", model=unets / "null", steps=STEPS)
    assert gen.null_class and gen.num_classes == 3 and gen.num_embeds == 4
    assert gen.unet.config[NULL_CLASS] is True
    plain = load_generator("unet", model=unets / "plain", steps=STEPS)
    assert not plain.null_class and plain.num_classes == 3 and plain.num_embeds == 3


def test_guidance_one_is_byte_identical_to_a_unet_without_the_null_row(unets):
    with_null = load_generator("unet", model=unets / "null", steps=STEPS, guidance=1.0)
    without = load_generator("unet", model=unets / "plain", steps=STEPS)
    assert torch.equal(with_null.generate_series(SPECS), without.generate_series(SPECS))


def test_guided_sampling_matches_an_independent_loop(unets):
    """ε = ε(x, ∅) + w·(ε(x, c) − ε(x, ∅)), with two separate model calls per step here and one
    batched call in the backend: equal up to float rounding (at most one uint8 level)."""
    w = 2.5
    gen = load_generator("unet", model=unets / "null", steps=STEPS, guidance=w)
    images = gen.generate_series(SPECS[:1])[0]  # [3, 16, 16, 3]
    unet = gen.unet
    sched = DDIMScheduler.from_config(gen.scheduler.config)
    sched.set_timesteps(STEPS)
    noise = torch.randn((3, 16, 16), generator=torch.Generator().manual_seed(11))
    alphas = torch.tensor([1.0, 0.5, 0.0])
    cond = torch.zeros(3, 4)
    cond[:, 0], cond[:, 2] = alphas, 1 - alphas  # α·e_a + (1 − α)·e_b, a = 0, b = 2
    null = torch.zeros(3, 4)
    null[:, 3] = 1.0
    x = noise.expand(3, -1, -1, -1).clone()
    with torch.no_grad():
        for t in sched.timesteps:
            eps_c = unet(x, t, class_labels=cond).sample
            eps_null = unet(x, t, class_labels=null).sample
            x = sched.step(eps_null + w * (eps_c - eps_null), t, x).prev_sample
    expected = ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert (images.int() - expected.int()).abs().max() <= 1
    plain = load_generator("unet", model=unets / "null", steps=STEPS).generate_series(SPECS[:1])
    assert not torch.equal(plain[0], images)  # guidance changes the images


def test_guided_series_keep_shared_noise_and_batch_independence(unets):
    gen = load_generator("unet", model=unets / "null", steps=STEPS, guidance=2.0)
    one = torch.cat([gen.generate_series(SPECS, batch_size=1)])
    seven = gen.generate_series(SPECS, batch_size=7)
    assert torch.equal(one, seven)
    # α = 1 of (a, b) is the pure class-a image of the same noise, α = 0 the pure class b
    pure = gen.generate_series([SeriesSpec(5, 0, 0, (1.0,), seed=11)])
    assert torch.equal(one[0, 0], pure[0, 0])
    swapped = gen.generate_series([SeriesSpec(6, 2, 0, (0.0, 1.0), seed=11)])
    assert torch.equal(one[0, 0], swapped[0, 0]) and torch.equal(one[0, 2], swapped[0, 1])


def test_a_unet_without_the_null_row_refuses_guidance(unets):
    gen = load_generator("unet", model=unets / "plain", steps=STEPS, guidance=2.0, lazy=True)
    with pytest.raises(ValueError, match="no null condition") as err:
        gen.load()
    assert "label_dropout" in str(err.value) and "\n" not in str(err.value)


def test_a_calls_guidance_samples_as_the_generator_built_with_it_and_changes_nothing(unets):
    """generate_series(guidance=w) is, byte for byte, the generator built with w, and the
    generator keeps its own w (fit-generator judges one generator at every w of its grid)."""
    built = load_generator("unet", model=unets / "null", steps=STEPS, guidance=2.5)
    gen = load_generator("unet", model=unets / "null", steps=STEPS)
    assert torch.equal(gen.generate_series(SPECS, guidance=2.5), built.generate_series(SPECS))
    assert gen.guidance == 1.0 and built.guidance == 2.5
    assert torch.equal(gen.generate_series(SPECS), built.generate_series(SPECS, guidance=1.0))


def test_a_unet_without_the_null_row_refuses_a_calls_guidance(unets):
    gen = load_generator("unet", model=unets / "plain", steps=STEPS)
    with pytest.raises(ValueError, match="no null condition") as err:
        gen.generate_series(SPECS, guidance=2.0)
    assert "label_dropout" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=">= 0"):
        gen.generate_series(SPECS, guidance=-1.0)
    assert gen.guidance == 1.0 and gen.generate_series(SPECS, guidance=1).shape[0] == 2


def test_guidance_rescale_pulls_the_guided_prediction_towards_the_conditional_std(unets):
    """φ = 0 is plain guidance, byte for byte; φ > 0 changes the images (bench/bench_levers.py
    measures what it does to fidelity)."""
    gen = load_generator("unet", model=unets / "null", steps=STEPS, guidance=2.5)
    plain = gen.generate_series(SPECS)
    gen.guidance_rescale = 0.0
    assert torch.equal(gen.generate_series(SPECS), plain)
    gen.guidance_rescale = 0.7
    assert not torch.equal(gen.generate_series(SPECS), plain)
