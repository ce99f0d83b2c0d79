"""Encoders: preprocessing, batching (each image once), tiny OpenCLIP / HF CLIP loaded from disk."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from conftest import tiny_openclip as build_tiny_openclip
from torch import nn

from models.annotation import text_prototypes
from models.encoders import (
    ENCODERS,
    HFCLIPEncoder,
    ModuleFeatureEncoder,
    OpenCLIPEncoder,
    build_encoder,
)

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group("encoders")

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
TINY_CLIP = "semix-test-tiny-clip"


def _images(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size, size, 3), generator=g, dtype=torch.uint8)


def _smooth_images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """Low-frequency images: interpolation differences stay at rounding level on these."""
    small = _images(n, 4, seed).permute(0, 3, 1, 2).float()
    big = nn.functional.interpolate(small, size=(size, size), mode="bilinear", align_corners=True)
    return big.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class CountingNet(nn.Module):
    """forward_features = per-channel mean and max of the input; counts calls and images."""

    feature_dim = 6

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.images = 0, 0

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.images += x.shape[0]
        return torch.cat([x.mean(dim=(2, 3)), x.amax(dim=(2, 3))], dim=1)


def _module_encoder(net: nn.Module, image_size: int = 16, batch_size: int = 4):
    return ModuleFeatureEncoder(
        net, image_size, MEAN, STD, {"run": "r1"}, device="cpu", batch_size=batch_size
    )


def test_module_encoder_encodes_each_image_once_in_order():
    net = CountingNet()
    enc = _module_encoder(net, batch_size=4)
    images = _images(10)
    feats = enc.encode(images)
    assert feats.shape == (10, 6) and feats.dtype == torch.float32
    assert net.calls == 3 and net.images == 10  # ceil(10 / 4) batches, each image once
    x = (
        images.permute(0, 3, 1, 2).float() / 255 - torch.tensor(MEAN)[:, None, None]
    ) / torch.tensor(STD)[:, None, None]
    torch.testing.assert_close(feats, net.forward_features(x))
    assert enc.feature_dim == 6
    assert enc.identity["kind"] == "module" and enc.identity["run"] == "r1"
    assert enc.identity["mean"] == pytest.approx(MEAN)
    assert enc.encode(images[:0]).shape == (0, 6)
    # the identity names what the features depend on (annotate compares it on reruns): the
    # batch size changes neither, the normalisation changes both
    other_batch = _module_encoder(CountingNet(), batch_size=3)
    assert other_batch.identity == enc.identity
    torch.testing.assert_close(other_batch.encode(images), feats, rtol=0, atol=1e-6)
    shifted = ModuleFeatureEncoder(
        CountingNet(), 16, (0.4, *MEAN[1:]), STD, {"run": "r1"}, device="cpu"
    )
    assert shifted.identity != enc.identity
    assert not torch.allclose(shifted.encode(images), feats)
    with pytest.raises(ValueError, match="JSON-able"):  # it goes into manifests
        ModuleFeatureEncoder(CountingNet(), 16, MEAN, STD, {"run": object()}, device="cpu")


def test_module_encoder_resizes_to_its_image_size_and_probes_dim():
    class Flat(nn.Module):
        def forward_features(self, x):
            return x.flatten(1)

    enc = _module_encoder(Flat(), image_size=8)
    assert enc.feature_dim == 3 * 8 * 8  # no declared dim: probed with one blank image
    assert enc.encode(_images(3, size=16)).shape == (3, 192)


def test_module_encoder_feeds_grey_classifiers_one_channel():
    net = CountingNet()
    net.in_channels = 1
    enc = ModuleFeatureEncoder(net, 16, (0.5,), (0.25,), {}, device="cpu")
    images = _images(3)
    x = (images.float().mean(-1) / 255 - 0.5) / 0.25
    torch.testing.assert_close(enc.encode(images)[:, 0], x.mean(dim=(1, 2)))
    with pytest.raises(ValueError, match="channels"):
        ModuleFeatureEncoder(net, 16, MEAN, STD, {}, device="cpu")


def test_encoder_rejects_bad_input():
    enc = _module_encoder(CountingNet())
    with pytest.raises(ValueError, match="uint8"):
        enc.encode(torch.zeros(2, 16, 16, 3))
    with pytest.raises(ValueError, match=r"\[N, H, W, 3\]"):
        enc.encode(torch.zeros(2, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="text"):
        enc.encode_text(["a photo of a cat."])
    with pytest.raises(ValueError, match="forward_features"):
        ModuleFeatureEncoder(nn.Linear(2, 2), 16, MEAN, STD, {}, device="cpu")
    with pytest.raises(ValueError, match="precision"):
        ModuleFeatureEncoder(CountingNet(), 16, MEAN, STD, {}, device="cpu", precision="fp8")
    with pytest.raises(ValueError, match=re.escape(f"valid: {sorted(ENCODERS)}")):
        build_encoder("clip", model_name="ViT-B-32")
    # the registry builds the same encoder as the class itself
    built = build_encoder(
        "module", module=CountingNet(), image_size=16, mean=MEAN, std=STD, identity={}, device="cpu"
    )
    direct = ModuleFeatureEncoder(CountingNet(), 16, MEAN, STD, {}, device="cpu")
    assert built.identity == direct.identity
    assert torch.equal(built.encode(_images(3)), direct.encode(_images(3)))


def test_bf16_autocast_runs_and_returns_float32():
    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 5)

        def forward_features(self, x):
            return self.fc(x.mean(dim=(2, 3)))  # bf16 under autocast

    net = Lin()
    fp32 = ModuleFeatureEncoder(net, 16, MEAN, STD, {}, device="cpu").encode(_images(2))
    bf16 = ModuleFeatureEncoder(net, 16, MEAN, STD, {}, device="cpu", precision="bf16")
    out = bf16.encode(_images(2))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fp32, atol=0.05, rtol=0.05)


# -- OpenCLIP: tiny model from a config, saved to a file, loaded by path ------------------------


@pytest.fixture(scope="module")
def tiny_openclip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openclip")
    model = build_tiny_openclip(folder, TINY_CLIP, layers=2, width=64, head_width=32)
    from safetensors.torch import save_file

    save_file(model.state_dict(), folder / "tiny.safetensors")
    torch.save(model.state_dict(), folder / "tiny.pt")
    return model, folder


def test_openclip_checkpoint_file_gives_the_in_memory_features(tiny_openclip):
    import open_clip

    model, folder = tiny_openclip
    images = _images(7, size=32)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN)[:, None, None]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    with torch.no_grad():
        expected = model.encode_image((images.permute(0, 3, 1, 2).float() / 255 - mean) / std)
    for name in ("tiny.safetensors", "tiny.pt"):  # .pt goes through torch.load(weights_only=True)
        enc = OpenCLIPEncoder(TINY_CLIP, str(folder / name), device="cpu", batch_size=3)
        torch.testing.assert_close(enc.encode(images), expected, atol=1e-5, rtol=1e-5)
        sha = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert enc.identity["checkpoint_sha256"] == sha and enc.identity["image_size"] == [32, 32]
        assert enc.feature_dim == 16
    # zero-shot text tower and text prototypes
    tok = open_clip.get_tokenizer(TINY_CLIP)
    with torch.no_grad():
        text_expected = model.encode_text(tok(["a photo of a cat.", "a cat"]))
    protos = text_prototypes(enc, ["cat"], ("a photo of a {}.", "a {}"))
    torch.testing.assert_close(protos[0], text_expected.mean(0), atol=1e-5, rtol=1e-5)


def test_openclip_tag_resolves_through_the_hub_cache_to_the_same_file_path(
    tiny_openclip, tmp_path, monkeypatch
):
    """A tag (here a test tag whose weights sit in an offline Hub cache) loads like a file,
    and the tag's own preprocessing (mean/std) is applied."""
    import huggingface_hub.constants
    import open_clip
    from open_clip.pretrained import _pcfg

    model, folder = tiny_openclip
    tag = _pcfg(hf_hub="semix/tiny-clip/", mean=MEAN, std=STD)
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, TINY_CLIP, {"semixtest": tag})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "models--semix--tiny-clip"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    weights = (folder / "tiny.safetensors").read_bytes()
    (repo / "snapshots" / commit / "open_clip_model.safetensors").write_bytes(weights)

    enc = OpenCLIPEncoder(TINY_CLIP, "semixtest", device="cpu", cache_dir=str(tmp_path))
    assert enc.identity["pretrained"] == "semixtest" and enc.identity["mean"] == pytest.approx(MEAN)
    images = _images(3, size=32)
    x = (
        images.permute(0, 3, 1, 2).float() / 255 - torch.tensor(MEAN)[:, None, None]
    ) / torch.tensor(STD)[:, None, None]
    with torch.no_grad():
        expected = model.encode_image(x)
    torch.testing.assert_close(enc.encode(images), expected, atol=1e-5, rtol=1e-5)


def test_openclip_random_init_is_seeded_and_leaves_global_rng_alone(tiny_openclip):
    state = torch.random.get_rng_state()
    a = OpenCLIPEncoder(TINY_CLIP, None, init_seed=3, device="cpu")
    b = OpenCLIPEncoder(TINY_CLIP, None, init_seed=3, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)
    images = _images(2, size=32)
    assert torch.equal(a.encode(images), b.encode(images))
    assert a.identity["pretrained"] is None and a.identity["init_seed"] == 3


def test_openclip_preprocessing_matches_pil_transform_on_upsampling(tiny_openclip):
    """32x32 -> 224 style upsampling in torch stays at uint8-rounding distance from PIL's."""
    import open_clip
    from PIL import Image

    _, folder = tiny_openclip
    enc = OpenCLIPEncoder(TINY_CLIP, str(folder / "tiny.safetensors"), device="cpu")
    _, _, pil_transform = open_clip.create_model_and_transforms(TINY_CLIP)
    images = _smooth_images(4, size=12)  # upsampled to 32 by both
    ours = enc.preprocess(images)
    ref = torch.stack([pil_transform(Image.fromarray(im.numpy())) for im in images])
    diff = (ours - ref).abs() * torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    assert diff.mean() < 1 / 255 and diff.max() < 4 / 255


def test_openclip_missing_weights_give_one_line_error(tmp_path, monkeypatch, tiny_openclip):
    import huggingface_hub.constants

    with pytest.raises(ValueError, match=r"encoder\.pretrained=/path/to/checkpoint") as err:
        OpenCLIPEncoder(TINY_CLIP, str(tmp_path / "missing.safetensors"), device="cpu")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="ViT-B-32/openai") as err:
        OpenCLIPEncoder("ViT-B-32", "openai", device="cpu", cache_dir=str(tmp_path))
    assert "\n" not in str(err.value) and "encoder.pretrained=" in str(err.value)
    with pytest.raises(ValueError, match="unknown OpenCLIP model"):
        OpenCLIPEncoder("ViT-Nope", "openai", device="cpu")


# -- Hugging Face CLIP: tiny model saved with save_pretrained, loaded by folder ------------------


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    folder = tmp_path_factory.mktemp("hfclip")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz.":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)
    small = {
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    cfg = CLIPConfig(
        text_config={
            **small,
            "vocab_size": len(vocab),
            "max_position_embeddings": 32,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        },
        vision_config={**small, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CLIPModel(cfg).eval()
    model.save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(folder)
    return model, folder


def _pooled(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def test_hf_clip_folder_gives_the_in_memory_features(tiny_hf_clip):
    from transformers import CLIPImageProcessor, CLIPTokenizer

    model, folder = tiny_hf_clip
    enc = HFCLIPEncoder(str(folder), device="cpu", batch_size=2)
    images = _images(5, size=32)
    pixel_values = CLIPImageProcessor.from_pretrained(folder)(
        images=[im.numpy() for im in images], return_tensors="pt"
    )["pixel_values"]
    torch.testing.assert_close(enc.preprocess(images), pixel_values, atol=1e-5, rtol=0)
    with torch.no_grad():
        expected = _pooled(model.get_image_features(pixel_values=pixel_values))
    torch.testing.assert_close(enc.encode(images), expected, atol=1e-5, rtol=1e-5)
    assert enc.feature_dim == 16 and "model.safetensors" in enc.identity["weights_sha256"]
    prompts = ["a photo of a cat.", "a dog"]
    tok = CLIPTokenizer.from_pretrained(folder)(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        text_expected = _pooled(model.get_text_features(**tok))
    torch.testing.assert_close(enc.encode_text(prompts), text_expected, atol=1e-5, rtol=1e-5)


def test_hf_clip_missing_folder_gives_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="cannot be loaded") as err:
        HFCLIPEncoder(str(tmp_path / "nothing-here"), device="cpu")
    assert "\n" not in str(err.value)
