"""bench/bench_cost.py: its FLOP counts against hand counts and against what the dit backend runs,
its work read from the presets (docs/scale.md, "Expected cost of an ImageNet CSM set")."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_vae
from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel
from torch import nn
from torch.nn import functional as F

from bench.bench_cost import CSM_MEMBERS, count_flops, dit_flops, imagenet_work
from models.generators import load_generator
from pipeline.registry import resolve_stage_config


def test_count_flops_gives_the_hand_count_of_linear_conv_and_their_backward():
    lin, x = nn.Linear(7, 5), torch.randn(3, 7)
    fwd = 2 * 3 * 7 * 5  # 2 FLOPs per multiply-add of [3, 7] @ [7, 5]
    assert count_flops(lambda: lin(x)) == fwd
    # backward: the weight gradient only (input without grad), then the input's gradient too
    assert count_flops(lambda: lin(x).sum().backward()) == 2 * fwd
    assert count_flops(lambda: lin(x.clone().requires_grad_()).sum().backward()) == 3 * fwd
    conv, img = nn.Conv2d(3, 4, kernel_size=3), torch.randn(2, 3, 8, 8)
    assert count_flops(lambda: conv(img)) == 2 * (2 * 4 * 6 * 6) * (3 * 3 * 3)


def test_the_meta_device_counts_what_the_cpu_counts_and_attention_too():
    """The bench counts on the meta device: the same numbers as real tensors for matmuls and
    convolutions, and attention (which torch's CPU kernel leaves uncounted) as its two bmm."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10))
    x = torch.randn(4, 3, 8, 8)
    meta = net.to("meta")
    assert count_flops(lambda: meta(x.to("meta"))) == 2 * 4 * 8 * 64 * 27 + 2 * 4 * 512 * 10
    q = torch.zeros(2, 3, 5, 4, device="meta")  # [B, heads, tokens, head dim]
    assert count_flops(lambda: F.scaled_dot_product_attention(q, q, q)) == 2 * (
        2 * 2 * 3 * 5 * 5 * 4
    )


@pytest.fixture(scope="module")
def tiny_dit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dit")
    transformer = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        sample_size=4, patch_size=2, num_embeds_ada_norm=1000,
    )  # fmt: skip
    DiTPipeline(transformer=transformer, vae=tiny_vae(), scheduler=DDIMScheduler()).save_pretrained(
        folder
    )
    return folder


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_dit_flops_add_up_to_what_the_dit_backend_runs(tiny_dit, guidance):
    """steps x forward (twice the rows only with guidance > 1) + one VAE decode per image: the
    count of the backend's own sampling loop over a batch."""
    steps, batch = 3, 4
    gen = load_generator("dit", model=tiny_dit, class_ids=[7, 2, 5], guidance=guidance,
                         steps=steps, image_size=8)  # fmt: skip
    noise = torch.randn(batch, *gen.noise_shape)
    cond = gen.condition(torch.tensor([[0, 1]] * batch), torch.tensor([[0.25, 0.75]] * batch))
    with torch.no_grad():
        counted = count_flops(lambda: gen.sample(noise, cond))
    per = dit_flops(gen.transformer, gen.vae, steps=steps, guidance=guidance, batch=batch)
    assert batch * (per["denoiser"] + per["decode"]) == pytest.approx(counted, rel=1e-12)
    plain = dit_flops(gen.transformer, gen.vae, steps=steps, guidance=1.0, batch=batch)
    assert per["denoiser"] == (2 if guidance > 1 else 1) * plain["denoiser"]
    assert per["decode"] == plain["decode"] > 0


def test_the_work_comes_from_the_presets_and_follows_their_overrides():
    gen = resolve_stage_config("generate", "imagenet")
    w = imagenet_work()
    assert w["pairs"] == math.comb(len(gen.backend.dit.class_ids), 2)
    assert w["images"] == w["pairs"] * gen.mixing.series_per_pair * gen.mixing.alphas
    assert w["encoded"] == w["images"] + w["real_train"]  # prototypes from real/train
    assert w["real_train"] + w["real_val"] == 1_281_167
    more = imagenet_work(
        {"generate": ["mixing.series_per_pair=3", "mixing.alphas=5"], "train": ["epochs=7"],
         "annotate": ["prototypes=text"], "prepare": ["val_fraction=0.2"]}
    )  # fmt: skip
    assert more["images"] == w["pairs"] * 3 * 5
    assert more["shards"] == math.ceil(more["series"] / more["plan"].series_per_shard)
    assert more["encoded"] == more["images"]  # text prototypes: no real image encoded
    assert more["real_val"] == round(0.2 * 1_281_167)
    assert more["trained_csm"] == 7 * more["real_train"] * (1 + CSM_MEMBERS)
    assert more["trained_ce"] == 7 * more["real_train"]
