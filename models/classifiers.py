"""Image classifiers with a separable feature extractor and linear head.

Every model is a `Classifier`: `forward_features(x) -> [B, d]` returns the pooled pre-classifier
feature h (what MaC-Cal's bottleneck head and FeDLaS's NCI read, docs/methods.md §4-5), `head` is a plain
`nn.Linear(d, C)` that fine-tuning stages may replace, and `forward(x) = head(forward_features(x))`.

Architectures (the CIFAR ones use a 3x3 stride-1 stem and no max-pool, so 32x32 inputs keep their
resolution in the first stage; global average pooling makes all of them size-agnostic):

| name        | body                                                    | d    |
|-------------|---------------------------------------------------------|------|
| resnet18/34 | basic blocks [2,2,2,2] / [3,4,6,3], widths 64..512      | 512  |
| resnet50    | bottleneck blocks [3,4,6,3] (CSM reference, docs/methods.md §3) | 2048 |
| resnet110   | He et al.'s 3-stage CIFAR net, 18 basic blocks/stage    | 64   |
| wrn-26-10   | post-activation basic blocks, (26-2)/6 = 4 per stage    | 640  |
| wrn-28-10   | Zagoruyko's pre-activation blocks, (28-4)/6 = 4/stage   | 640  |
| digits-cnn  | 3 convs + 2 max-pools, for 16x16 digits (~1 s/epoch)    | 128  |
| conv-mlp    | 2 convs + 2 max-pools, FC 256 (Fashion-MNIST study)     | 256  |
| timm:<name> | any timm model, `num_classes=0` as the feature extractor | timm |

Notes on the reference nets: resnet110 uses 1x1-conv projection shortcuts (He et al.'s option B)
rather than zero-padding; the focal-loss calibration code's "resnet110" is instead a 4-stage
bottleneck net, which we do not copy. wrn-26-10 follows that calibration code's definition
(ResNet-style blocks, depth counted as 6n+2); wrn-28-10 is the original WRN (6n+4).

A model is rebuilt from `arch_config()` (JSON-able) with `classifier_from_config`, so a stage can
save config.json + safetensors and load them back without pickles. The config holds every
constructor argument (its `family`, the class in FAMILIES, and the widths and depths), so a
saved model rebuilds as it was even if the registry's entry for its name changes; a config of
the name alone (a class of no family; docs/compat.md) is rebuilt through CLASSIFIERS.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TIMM_PREFIX = "timm:"


NAME_KEYS = ("arch", "num_classes", "in_channels")  # what every arch config holds


class Classifier(nn.Module):
    """Base class: subclasses define `forward_features`; the head is shared logic. A subclass
    with a `family` (its FAMILIES name) sets `args`, its other constructor arguments (JSON-able),
    so that `arch_config()` rebuilds it without the registry."""

    family = ""

    def __init__(self, arch: str, num_classes: int, in_channels: int, feature_dim: int) -> None:
        super().__init__()
        self.arch = arch
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.feature_dim = feature_dim
        self.head: nn.Module = nn.Linear(feature_dim, num_classes)
        self.args: dict[str, Any] = {}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled pre-classifier features h, shape [B, feature_dim]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))

    def arch_config(self) -> dict:
        """JSON-able dict that `classifier_from_config` turns back into this architecture."""
        names = {key: getattr(self, key) for key in NAME_KEYS}
        return {**names, "family": self.family, **self.args} if self.family else names


def _init_weights(module: nn.Module) -> None:
    # He init for convs (ReLU nets), unit BN: the usual CIFAR recipe; Linear keeps torch's default.
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


def _projection(c_in: int, c_out: int, stride: int) -> nn.Module:
    """Identity when shapes match, else a 1x1 strided conv + BN (option B shortcut)."""
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
    )


class BasicBlock(nn.Module):
    """Post-activation residual block: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(c_in, width, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width), nn.BatchNorm2d(width)
        self.shortcut = _projection(c_in, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (strided) -> 1x1 expand (x4), post-activation."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out)
        self.shortcut = _projection(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class PreActBlock(nn.Module):
    """WRN block: conv(relu(bn(conv(relu(bn(x)))))) + shortcut; the shortcut sees the
    pre-activated input when it projects (Zagoruyko & Komodakis 2016)."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(c_in), _conv3x3(c_in, width, stride)
        self.bn2, self.conv2 = nn.BatchNorm2d(width), _conv3x3(width, width)
        project = stride != 1 or c_in != width
        self.shortcut = nn.Conv2d(c_in, width, 1, stride=stride, bias=False) if project else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(x))
        out = self.conv2(F.relu(self.bn2(self.conv1(a))))
        return out + (self.shortcut(a) if self.shortcut is not None else x)


BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck] | type[PreActBlock]] = {
    "basic": BasicBlock,
    "bottleneck": Bottleneck,
    "preact": PreActBlock,
}


class CifarResNet(Classifier):
    """3x3 stem -> stages of residual blocks (first block of each later stage strides 2) -> GAP.

    `pre_activation` selects the WRN layout: the stem has no BN/ReLU of its own and a final
    BN-ReLU follows the last stage, because pre-activation blocks end on a bare conv.
    """

    family = "cifar-resnet"

    def __init__(
        self,
        arch: str,
        num_classes: int,
        in_channels: int,
        block: str,
        blocks_per_stage: list[int],
        widths: list[int],
        stem_width: int,
    ) -> None:
        unit = BLOCKS[block]
        super().__init__(arch, num_classes, in_channels, widths[-1] * unit.expansion)
        self.args = dict(
            block=block,
            blocks_per_stage=list(blocks_per_stage),
            widths=list(widths),
            stem_width=stem_width,
        )
        pre_activation = unit is PreActBlock
        stem: list[nn.Module] = [_conv3x3(in_channels, stem_width)]
        if not pre_activation:
            stem += [nn.BatchNorm2d(stem_width), nn.ReLU(inplace=True)]
        self.stem = nn.Sequential(*stem)
        stages, c = [], stem_width
        for i, (n, w) in enumerate(zip(blocks_per_stage, widths, strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(unit(c, w, 2 if (i > 0 and j == 0) else 1))
                c = w * unit.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.final = (
            nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True))
            if pre_activation
            else nn.Identity()
        )
        _init_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final(self.stages(self.stem(x)))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def _pooled_unit(c_in: int, c_out: int) -> list[nn.Module]:
    """conv-BN, then 2x2 max-pool and ReLU: relu(pool(x)) = pool(relu(x)) exactly (ReLU is
    monotone, so both take the same maximum; gradients too), and the ReLU then reads a quarter
    of the activations. Parameter names are those of conv-BN-ReLU-pool (ReLU and pool have none)."""
    return [_conv3x3(c_in, c_out), nn.BatchNorm2d(c_out), nn.MaxPool2d(2), nn.ReLU(inplace=True)]


class DigitsCNN(Classifier):
    """Small CNN for 16x16 digits: conv-BN-ReLU blocks of width 32 @16x16, 64 @8x8 and
    128 @4x4 (max-pool between), then GAP.

    ~0.1 M parameters and ~2.6 MFLOPs per image, so the embedded default reaches > 90 % on the
    digits within a few epochs of a second each on 2 CPU cores; its pooled features double as
    the annotation space for digits.
    """

    family = "digits-cnn"

    def __init__(self, arch: str, num_classes: int, in_channels: int, width: int = 32) -> None:
        super().__init__(arch, num_classes, in_channels, feature_dim=4 * width)
        self.args = dict(width=width)

        self.body = nn.Sequential(
            *_pooled_unit(in_channels, width),
            *_pooled_unit(width, 2 * width),
            _conv3x3(2 * width, 4 * width),
            nn.BatchNorm2d(4 * width),
            nn.ReLU(inplace=True),
        )
        _init_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(self.body(x), 1), 1)


class ConvMLP(Classifier):
    """LeNet-style net for 28x28 grey images: two conv-BN-ReLU + max-pool stages (width 32),
    pooled to 7x7, flattened, then a 256-unit fully connected ReLU layer (the feature h).

    The wide fully connected layer is what lets it fit a small training set and become
    overconfident on test under plain CE, the situation calibration methods address; ~0.4 M
    parameters and ~2.4 M multiply-adds per image, so the Fashion-MNIST study runs on 2 CPU cores.
    """

    family = "conv-mlp"

    def __init__(
        self, arch: str, num_classes: int, in_channels: int, width: int = 32, hidden: int = 256
    ) -> None:
        super().__init__(arch, num_classes, in_channels, feature_dim=hidden)
        self.args = dict(width=width, hidden=hidden)

        self.body = nn.Sequential(*_pooled_unit(in_channels, width), *_pooled_unit(width, width))
        self.fc = nn.Sequential(nn.Linear(width * 7 * 7, hidden), nn.ReLU(inplace=True))
        _init_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if h.shape[-2:] != (7, 7):  # 28x28 inputs are 7x7 here already: no pass over them
            h = F.adaptive_avg_pool2d(h, 7)
        return self.fc(torch.flatten(h, 1))


class TimmClassifier(Classifier):
    """Any timm model; `num_classes=0` makes timm return its pooled pre-logits features. Its
    arch config is timm's name: the architecture is timm's, and `pretrained` only says where the
    first weights came from (a saved model loads its own on top)."""

    family = "timm"

    def __init__(
        self, arch: str, num_classes: int, in_channels: int, pretrained: bool = False
    ) -> None:
        import timm  # local import: timm is heavy and only this model family needs it

        name = arch.removeprefix(TIMM_PREFIX)
        if not timm.is_model(name):
            raise ValueError(f"unknown timm model {name!r}; see timm.list_models() for valid names")
        try:
            backbone = timm.create_model(
                name, pretrained=pretrained, num_classes=0, in_chans=in_channels
            )
        except OSError as err:  # huggingface_hub raises OSError subclasses when it cannot fetch
            raise RuntimeError(
                f"cannot fetch pretrained weights for timm model {name!r} (offline?); "
                "populate the Hugging Face cache first or use pretrained=False"
            ) from err
        # what num_classes=0 returns: the pre-logits width, which differs from num_features
        # where a head layer follows the pooling (MobileNetV3's conv_head: 288 -> 1024)
        width = getattr(backbone, "head_hidden_size", None) or backbone.num_features
        super().__init__(arch, num_classes, in_channels, feature_dim=int(width))
        self.backbone = backbone

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


ClassifierFactory = Callable[[str, int, int], Classifier]

# name -> factory(arch, num_classes, in_channels). `timm:<name>` is resolved in build_classifier.
CLASSIFIERS: dict[str, ClassifierFactory] = {
    "resnet18": partial(
        CifarResNet,
        block="basic",
        blocks_per_stage=[2, 2, 2, 2],
        widths=[64, 128, 256, 512],
        stem_width=64,
    ),
    "resnet34": partial(
        CifarResNet,
        block="basic",
        blocks_per_stage=[3, 4, 6, 3],
        widths=[64, 128, 256, 512],
        stem_width=64,
    ),
    "resnet50": partial(
        CifarResNet,
        block="bottleneck",
        blocks_per_stage=[3, 4, 6, 3],
        widths=[64, 128, 256, 512],
        stem_width=64,
    ),
    "resnet110": partial(
        CifarResNet,
        block="basic",
        blocks_per_stage=[18, 18, 18],
        widths=[16, 32, 64],
        stem_width=16,
    ),
    "wrn-26-10": partial(
        CifarResNet,
        block="basic",
        blocks_per_stage=[4, 4, 4],
        widths=[160, 320, 640],
        stem_width=16,
    ),
    "wrn-28-10": partial(
        CifarResNet,
        block="preact",
        blocks_per_stage=[4, 4, 4],
        widths=[160, 320, 640],
        stem_width=16,
    ),
    "digits-cnn": DigitsCNN,
    "conv-mlp": ConvMLP,
}


def build_classifier(
    name: str, num_classes: int, in_channels: int = 3, *, pretrained: bool = False
) -> Classifier:
    """Build a classifier by registry name or `timm:<model>`.

    `pretrained` only applies to timm models (the CIFAR nets are trained from scratch in the
    papers); it raises one RuntimeError line when the weights cannot be fetched offline.
    """
    if num_classes < 1 or in_channels < 1:
        raise ValueError(
            f"num_classes and in_channels must be >= 1, got {num_classes}, {in_channels}"
        )
    if name.startswith(TIMM_PREFIX):
        return TimmClassifier(name, num_classes, in_channels, pretrained=pretrained)
    if name not in CLASSIFIERS:
        valid = ", ".join([*CLASSIFIERS, f"{TIMM_PREFIX}<timm model name>"])
        raise ValueError(f"unknown classifier {name!r}; valid: {valid}")
    if pretrained:
        raise ValueError(
            f"pretrained weights exist only for {TIMM_PREFIX}<name> models, not {name!r}"
        )
    return CLASSIFIERS[name](name, num_classes, in_channels)


# family -> its class: what a full arch config (`family` and its constructor arguments) names
FAMILIES = {c.family: c for c in (CifarResNet, DigitsCNN, ConvMLP, TimmClassifier)}


def classifier_from_config(config: dict) -> Classifier:
    """Inverse of `Classifier.arch_config()`: same architecture, freshly initialised weights.
    A config with a `family` is built from its own arguments; one of the name alone (a registered
    class of no family; docs/compat.md) through CLASSIFIERS. Keys a
    caller adds for itself (`head`: models.finetuning) are not the classifier's.

    Weights are never fetched here (load the saved state dict on top), so this works offline.
    """
    missing = set(NAME_KEYS) - set(config)
    if missing:
        raise ValueError(
            f"classifier config lacks {sorted(missing)}; expected keys arch, num_classes, in_channels"
        )
    name, shape = config["arch"], (int(config["num_classes"]), int(config["in_channels"]))
    family = config.get("family")
    if not family:
        return build_classifier(name, *shape)
    if family not in FAMILIES:
        raise ValueError(f"unknown classifier family {family!r}; valid: {', '.join(FAMILIES)}")
    args = {k: v for k, v in config.items() if k not in (*NAME_KEYS, "family", "head")}
    try:
        return FAMILIES[family](name, *shape, **args)
    except (TypeError, KeyError) as e:  # an argument the family does not take, an unknown block
        raise ValueError(f"arch config of {name!r} ({family}) does not build: {e}") from None
