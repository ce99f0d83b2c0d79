"""Generator backends on tiny random-weight models, saved to disk and loaded back for real.

Each backend must show (issue 4): shared noise (α=1 of (a, b) == α=0 of (b, a) == the pure class-a
image from the same noise, the latter computed by an independent plain-label/plain-prompt path),
byte-identical output for batch sizes 1 and 7, seeds that matter, mixing that changes the image,
and a one-line error for a missing model.
"""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch
from conftest import tiny_vae
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from models.generators import (
    GENERATORS,
    UNET_PRESETS,
    EDMNetwork,
    NonFiniteImageError,
    SeriesSpec,
    build_unet,
    load_generator,
    make_scheduler,
    save_unet,
    unet_from_preset,
)

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group("generators")

STEPS = 3
NAMES = ["cat", "dog", "owl"]
DIT_IDS = [7, 2, 5]  # our class i -> DiT id


def _tokenizer(folder) -> CLIPTokenizer:
    """CLIP BPE over single characters: small vocab/merges files written here."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in [c + suffix for suffix in ("", "</w>") for c in string.ascii_lowercase]:
        vocab[token] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"), model_max_length=24
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Save one tiny model per backend with save_pretrained; the backends load them back."""
    root = tmp_path_factory.mktemp("generators")
    torch.manual_seed(0)  # random init of the tiny models only
    # unet: class-conditional pixel UNet + its training scheduler
    # (16, 32) at 16×16 is the smallest size where, on our CPU, a batch of 1 and of 7 round
    # differently without the row padding of Generator._sample_rows
    unet = build_unet(16, num_classes=3, channels=(16, 32), attention=(False, True))
    save_unet(root / "unet", unet, DDPMScheduler(num_train_timesteps=1000))
    # sd: UNet2DConditionModel + AutoencoderKL + CLIP text encoder/tokenizer
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=54, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=2,
            max_position_embeddings=24, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )
    )  # fmt: skip
    sd_unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    sd = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=text_encoder,
        tokenizer=_tokenizer(root),
        unet=sd_unet,
        scheduler=DDIMScheduler(clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    sd.save_pretrained(root / "sd")
    # dit: adaLN-Zero transformer, ImageNet-sized table (DiTPipeline hard-codes null id 1000), 4×4 latents
    transformer = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        sample_size=4, patch_size=2, num_embeds_ada_norm=1000,
    )  # fmt: skip
    DiTPipeline(transformer=transformer, vae=tiny_vae(), scheduler=DDIMScheduler()).save_pretrained(
        root / "dit"
    )
    # edm: a tiny class-conditional DDPM++/VP EDM network (tests/test_edm.py covers it in depth)
    EDMNetwork(img_resolution=8, label_dim=3, model_channels=8, channel_mult=[1, 2], num_blocks=1,
               attn_resolutions=[4]).save_pretrained(root / "edm")  # fmt: skip
    return root


def _kwargs(backend: str, root) -> dict:
    return {
        "unet": {"model": root / "unet"},
        "sd": {"model": root / "sd", "class_names": NAMES, "image_size": 8, "guidance": 3.0},
        "dit": {"model": root / "dit", "class_ids": DIT_IDS, "guidance": 2.0, "image_size": 8},
        "edm": {"model": root / "edm"},
    }[backend]


@pytest.fixture(scope="module", params=sorted(GENERATORS))
def backend(request, model_dirs):
    gen = load_generator(request.param, steps=STEPS, **_kwargs(request.param, model_dirs))
    return request.param, gen


def _pure_reference(name: str, gen, class_a: int, seed: int, root) -> torch.Tensor:
    """The plain class-a image from the series noise, by a path that does no mixing (8 rows, as
    a padded chunk of ``generate_series``, so the kernels see the same shapes)."""
    noise = gen.initial_noise(seed).expand(8, *gen.noise_shape).contiguous()
    if name == "edm":  # a one-hot label straight into the network's label layer
        x = gen.sample(noise, torch.nn.functional.one_hot(torch.full((8,), class_a), 3).float())
        return gen.to_uint8(x / 2 + 0.5)[0]
    if name == "unet":  # integer labels through the original embedding lookup
        x = gen.sample(noise, torch.full((8,), class_a))
        return gen.to_uint8(x / 2 + 0.5)[0]
    if name == "sd":  # the pipeline's own prompt path
        images = gen.pipe(
            prompt=gen.prompt(class_a), negative_prompt="", num_images_per_prompt=8, latents=noise,
            num_inference_steps=STEPS, guidance_scale=gen.guidance, output_type="pt",
        ).images  # fmt: skip
        return gen.to_uint8(images)[0]
    # dit: an independent DiTPipeline with plain ImageNet ids and per-sample CPU generators
    pipe = DiTPipeline.from_pretrained(root / "dit")
    pipe.scheduler = make_scheduler("ddim", pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        class_labels=[DIT_IDS[class_a]] * 8, guidance_scale=gen.guidance, num_inference_steps=STEPS,
        generator=[torch.Generator().manual_seed(seed) for _ in range(8)], output_type="np",
    ).images  # fmt: skip
    return gen.to_uint8(torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2))[0]


def test_shared_noise_endpoints(backend, model_dirs):
    name, gen = backend
    alphas = (1.0, 0.5, 0.0)
    out = gen.generate_series(
        [SeriesSpec(0, 0, 1, alphas, seed=11), SeriesSpec(1, 1, 0, alphas, seed=11)]
    )
    assert out.dtype == torch.uint8 and out.shape == (2, 3, gen.image_size, gen.image_size, 3)
    assert torch.equal(out[0, 0], out[1, 2])  # α=1 of (a, b) == α=0 of (b, a)
    assert torch.equal(out[0, 2], out[1, 0])
    assert torch.equal(out[0, 0], _pure_reference(name, gen, 0, 11, model_dirs))
    # mixing does something: the interior image differs from both endpoints
    assert not torch.equal(out[0, 1], out[0, 0]) and not torch.equal(out[0, 1], out[0, 2])


def test_batch_size_and_seed(backend):
    _, gen = backend
    alphas = tuple(k / 7 for k in range(8))  # K = 8, docs/methods.md §1 default
    specs = [SeriesSpec(i, i % 3, (i + 1) % 3, alphas, seed=100 + i) for i in range(3)]
    progress: list[int] = []
    one = gen.generate_series(specs, batch_size=1, progress=progress.append)
    seven = gen.generate_series(specs, batch_size=7)
    assert progress == [1] * 24
    assert torch.equal(one, seven)  # bytes never depend on the batch size
    # the same series in another company and position gives the same bytes
    alone = gen.generate_series([specs[1]], batch_size=5)
    assert torch.equal(alone[0], one[1])
    other_seed = gen.generate_series([SeriesSpec(1, 1, 2, alphas, seed=999)])
    assert not torch.equal(other_seed[0], one[1])


def test_metadata(backend):
    name, gen = backend
    meta = gen.metadata()
    assert meta["sampler"] == ("heun" if name == "edm" else "ddim") and meta["steps"] == STEPS
    assert meta["guidance"] == {"unet": 1.0, "sd": 3.0, "dit": 2.0, "edm": 1.0}[name]
    assert meta["model_id"].endswith(name) and meta["revision"] is None


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_missing_model_one_line(name, model_dirs, tmp_path):
    kwargs = _kwargs(name, model_dirs) | {"model": tmp_path / "not-there"}
    with pytest.raises(OSError) as err:
        load_generator(name, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and "not-there" in msg and "model=" in msg


def test_bad_choices(model_dirs):
    with pytest.raises(ValueError, match="unet"):
        load_generator("gan", model=model_dirs / "unet")
    for sampler in ("euler_ancestral", "sde-dpmsolver++", "ddpm"):
        with pytest.raises(ValueError, match="dpmsolver"):
            load_generator("unet", model=model_dirs / "unet", sampler=sampler)


@pytest.mark.parametrize("sampler", ["dpmsolver++", "unipc"])
def test_multistep_solvers_are_deterministic(model_dirs, sampler):
    """The same seed gives the same bytes (a second generator, another batch size), and a
    series' endpoint is the pure-class image of its noise; UniPC is not DDIM in disguise."""
    gen = load_generator("unet", model=model_dirs / "unet", sampler=sampler, steps=STEPS)
    again = load_generator("unet", model=model_dirs / "unet", sampler=sampler, steps=STEPS)
    specs = [SeriesSpec(i, 0, 2, (1.0, 0.5, 0.0), seed=i) for i in range(3)]
    one, seven = (
        gen.generate_series(specs, batch_size=1),
        again.generate_series(specs, batch_size=7),
    )
    assert torch.equal(one, seven) and torch.equal(
        one[0, 2], gen.generate_series([SeriesSpec(0, 2, 0, (1.0,), 0)])[0, 0]
    )
    assert gen.metadata()["sampler"] == sampler
    ddim = load_generator("unet", model=model_dirs / "unet", sampler="ddim", steps=STEPS)
    assert not torch.equal(one, ddim.generate_series(specs))


def test_unipc_pins_its_deterministic_settings():
    """A saved config naming other UniPC settings does not reach the sampler."""
    from diffusers import DDPMScheduler

    config = {
        **DDPMScheduler(clip_sample=False).config,
        "solver_type": "bh1",
        "disable_corrector": [0, 1],
    }
    sched = make_scheduler("unipc", config)
    assert sched.config.solver_type == "bh2" and list(sched.config.disable_corrector) == []
    assert sched.config.predict_x0 and not sched.config.thresholding


@pytest.mark.parametrize("sampler", ["dpmsolver++", "unipc"])
def test_multistep_solvers_clip_x0_exactly_where_the_training_config_clips(sampler):
    """DPM-Solver and UniPC have no clip_sample; a config that clips x0 (a pixel UNet's) must
    still get x0 clamped to its range, as DDIM would, else a rough ε model's samples blow up."""
    from diffusers import DDPMScheduler

    def sample(config) -> torch.Tensor:
        sched = make_scheduler(sampler, config)
        sched.set_timesteps(5)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        for t in sched.timesteps:  # an ε that puts x0 far outside [-1, 1]
            x = sched.step(-30.0 * x, t, x).prev_sample
        return x  # the last step returns its x0 prediction (final sigma 0)

    assert sample(DDPMScheduler(clip_sample=True).config).abs().max() == 1.0
    assert sample(DDPMScheduler(clip_sample=False).config).abs().max() > 1.0
    with pytest.raises(ValueError, match=r"only to \[-1, 1\].*\[-0.5, 0.5\]: use sampler=ddim"):
        make_scheduler(sampler, DDPMScheduler(clip_sample=True, clip_sample_range=0.5).config)


def test_non_finite_names_series(model_dirs, monkeypatch):
    gen = load_generator("unet", model=model_dirs / "unet", steps=2)
    clean = gen.initial_noise
    # stand-in for an fp16 overflow: the series with seed 2 turns non-finite
    monkeypatch.setattr(gen, "initial_noise", lambda seed: clean(seed) / (seed != 2))
    specs = [SeriesSpec(5, 0, 1, (1.0, 0.0), seed=1), SeriesSpec(6, 2, 1, (1.0, 0.0), seed=2)]
    with pytest.raises(NonFiniteImageError) as err:
        gen.generate_series(specs)
    assert err.value.series_ids == (6,)
    assert err.value.images[1].eq(0).all() and err.value.images[0].ne(0).any()


def test_unet_save_load_and_presets(model_dirs):
    gen = load_generator("unet", model=model_dirs / "unet")
    reloaded = build_unet(16, num_classes=3, channels=(16, 32), attention=(False, True)).eval()
    reloaded.load_state_dict(gen.unet.state_dict())  # mixable table keeps the state-dict keys
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = reloaded(x, 500, class_labels=torch.tensor([2, 0])).sample
        one_hot = gen.unet(x, 500, class_labels=torch.eye(3)[[2, 0]]).sample
    assert torch.equal(plain, one_hot)  # a one-hot mix is exactly the plain class embedding
    assert gen.image_size == 16 and gen.num_classes == 3
    assert gen.scheduler.config.num_train_timesteps == 1000  # the saved training schedule
    tiny, preset = unet_from_preset("digits-tiny", 10), UNET_PRESETS["digits-tiny"]
    assert tiny.config.sample_size == preset.image_size
    assert tuple(tiny.config.block_out_channels) == preset.block_out_channels
    assert 0.9e6 < sum(p.numel() for p in tiny.parameters()) < 1.3e6
    with pytest.raises(ValueError, match="digits-tiny"):
        unet_from_preset("huge", 10)
