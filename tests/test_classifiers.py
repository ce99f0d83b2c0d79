"""Classifier registry: shapes, separable head, config round trip, errors, digits training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from models.classifiers import (
    CLASSIFIERS,
    Classifier,
    build_classifier,
    classifier_from_config,
)

# (name, expected feature dim d); inputs are 8x8 so even WRN-28-10 forwards in well under 1 s
EXPECTED_DIM = {
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "resnet110": 64,
    "wrn-26-10": 640,
    "wrn-28-10": 640,
    "digits-cnn": 128,
    "conv-mlp": 256,
    "timm:resnet18": 512,
    "timm:mobilenetv3_small_050": 1024,  # pre-logits conv_head after the pool (288 -> 1024)
}


def test_registry_covers_issue_models():
    assert {n for n in EXPECTED_DIM if not n.startswith("timm:")} == set(CLASSIFIERS)


@pytest.mark.parametrize("name", list(EXPECTED_DIM))
def test_builds_and_gives_logits_and_features(name):
    model = build_classifier(name, num_classes=7)
    assert isinstance(model, Classifier) and isinstance(model.head, nn.Linear)
    assert model.feature_dim == EXPECTED_DIM[name] and model.num_classes == 7
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.forward_features(x)
        logits = model(x)
    assert h.shape == (2, EXPECTED_DIM[name]) and logits.shape == (2, 7)
    assert torch.allclose(logits, model.head(h), atol=1e-5)  # train-mode BN: same batch stats


def test_resnet110_is_the_three_stage_cifar_net():
    model = build_classifier("resnet110", 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 1 + 3 * 18 * 2  # stem + 54 blocks of two 3x3 convs (+ linear = 110)
    assert 1.6e6 < sum(p.numel() for p in model.parameters()) < 1.8e6  # He et al.: 1.7 M


def test_in_channels_and_replaceable_head():
    model = build_classifier("resnet18", 10, in_channels=1).eval()
    x = torch.randn(3, 1, 16, 16)
    model.head = nn.Linear(model.feature_dim, 4)
    with torch.no_grad():
        assert model(x).shape == (3, 4) and model.forward_features(x).shape == (3, 512)
    timm_model = build_classifier("timm:resnet18", 5, in_channels=1).eval()
    with torch.no_grad():
        assert timm_model(torch.randn(2, 1, 32, 32)).shape == (2, 5)


@pytest.mark.parametrize(
    ("name", "in_channels"), [("digits-cnn", 3), ("resnet110", 1), ("timm:resnet18", 3)]
)
def test_arch_config_round_trip_through_files(tmp_path, name, in_channels):
    model = build_classifier(name, 6, in_channels=in_channels).eval()
    (tmp_path / "config.json").write_text(json.dumps(model.arch_config()))
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))

    config = json.loads((tmp_path / "config.json").read_text())
    rebuilt = classifier_from_config(config)
    rebuilt.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    rebuilt.eval()
    assert rebuilt.arch_config() == config and type(rebuilt) is type(model)
    x = torch.randn(2, in_channels, 8, 8)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), model(x))


def test_model_json_holds_the_whole_architecture_and_old_name_only_ones_still_load(tmp_path):
    """A run's model.json holds every constructor argument (widths, depths, block), so it
    rebuilds as saved even where the registry's entry for its name says otherwise; model.json of
    a run written before (the name alone) still loads, through the registry."""
    from models.finetuning import arch_with_head, build_model
    from shards.runs import load_model, save_weights

    model = build_classifier("resnet110", 6, in_channels=1).eval()
    arch = model.arch_config()
    assert arch == {
        "arch": "resnet110", "num_classes": 6, "in_channels": 1, "family": "cifar-resnet",
        "block": "basic", "blocks_per_stage": [18, 18, 18], "widths": [16, 32, 64],
        "stem_width": 16,
    }  # fmt: skip
    assert build_model(arch_with_head(model)).arch_config() == arch  # a head is not its own
    x = torch.randn(2, 1, 8, 8)
    names = {"arch": "resnet110", "num_classes": 6, "in_channels": 1}
    meta = {"class_names": list("abcdef"), "image_size": 8, "normalize": {}}
    for name, saved in (("full", arch), ("old", names)):
        save_weights(tmp_path / name, model.state_dict(), meta | {"arch": saved})
        loaded, _ = load_model(tmp_path / name, build_model)
        with torch.no_grad():
            assert torch.equal(loaded.eval()(x), model(x)), name
        assert loaded.arch_config() == arch  # an old run's model, saved again, is in full
    narrow = classifier_from_config(arch | {"widths": [4, 8, 12], "blocks_per_stage": [1, 1, 1]})
    assert narrow.feature_dim == 12 and len(narrow.stages[0]) == 1  # the saved widths win
    assert narrow.arch_config()["widths"] == [4, 8, 12]
    with pytest.raises(ValueError, match="unknown classifier family 'nope'"):
        classifier_from_config(arch | {"family": "nope"})
    with pytest.raises(ValueError, match="does not build"):
        classifier_from_config(arch | {"depth": 3})
    wide = {**names, "arch": "digits-cnn", "family": "digits-cnn", "width": 8}
    assert classifier_from_config(wide).feature_dim == 32  # 4 x width


def test_bad_names_and_options_raise_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="valid: resnet18, resnet34"):
        build_classifier("resnet19", 10)
    with pytest.raises(ValueError, match="unknown timm model"):
        build_classifier("timm:no_such_net", 10)
    with pytest.raises(ValueError, match="only for timm"):
        build_classifier("resnet18", 10, pretrained=True)
    with pytest.raises(ValueError, match="num_classes"):
        build_classifier("resnet18", 0)
    with pytest.raises(ValueError, match="lacks"):
        classifier_from_config({"arch": "resnet18"})
    # offline: huggingface_hub cannot fetch, the user gets one RuntimeError line
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="cannot fetch pretrained weights.*offline"):
        build_classifier("timm:resnet18", 10, pretrained=True)


def test_digits_cnn_learns_16px_digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=16, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x, y = (x - 0.5) / 0.5, torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # weight init
    perm = torch.randperm(len(y), generator=g)
    train, val = perm[:1400], perm[1400:]
    model = build_classifier("digits-cnn", 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(6):
        model.train()
        order = train[torch.randperm(len(train), generator=g)]
        for i in range(0, len(order), 64):
            batch = order[i : i + 64]
            loss = F.cross_entropy(model(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x[val]).argmax(1) == y[val]).float().mean().item()
    assert acc > 0.9
