"""Config of the `annotate` stage: series/ + real/train -> runs/<classes>/mixed/ (docs/methods.md §2).

The `encoder` section picks the image encoder (`ENCODER_KINDS`, of models.encoders.ENCODERS)
and holds every encoder's parameters, derived from each one's `Params` by the `ENCODER` section
(core/parts.py): `cfg.encoder.name`, `cfg.encoder.openclip.model` (hf-clip's model too: the CLIP
kinds share it), `cfg.encoder.classifier.run`. So `--set encoder=classifier encoder.run=enc`,
`encoder.classifier.run=enc` and the flat `encoder_run=enc` (config.json's name, saying its
path once) do the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from core.config import ConfigError, StageConfig, check_choice, check_range, recorded_off_default
from core.parts import Params, Section, param
from core.precision import check_precision
from core.tree import section
from models.annotation import ANNOTATORS
from models.encoders import ENCODERS, HFCLIPEncoder, OpenCLIPEncoder
from stages.configs.legacy import legacy_names
from stages.presets import stage_presets

# encoder= -> its kind in the one encoder registry, models.encoders.ENCODERS. `classifier` is the
# `module` kind over the pooled features of a semix classifier trained in
# runs/<classes>/train/<encoder.classifier.run>/ (the stage reads that run).
ENCODER_KINDS = {"classifier": "module", "openclip": "openclip", "hf-clip": "hf-clip"}
# the ones with a text tower (prototypes=text)
TEXT_ENCODERS = tuple(name for name, kind in ENCODER_KINDS.items() if ENCODERS[kind].has_text)
PROTOTYPE_SOURCES = ("real", "text")


@dataclass(frozen=True)
class ClassifierParams(Params):
    """encoder=classifier's parameter: which semix run's pooled features encode the images."""

    run: str = param("encoder", field="encoder_run", doc="the run under runs/<classes>/train/")


@dataclass(frozen=True)
class EncoderPart:
    """An encoder as a part of the `encoder` section (core.parts.Part): its parameters are
    leaves `encoder.<encoder>.<param>`, recorded in every mixed/ since the first under the flat
    names their `field=` gives (`encoder_model`)."""

    params: type[Params]
    prefix: str = "encoder"
    every_run: bool = True


# encoder= -> its parameters; `--set encoder.model=ViT-B-16` sets the picked encoder's
ENCODER = Section(
    "encoder",
    {
        "openclip": EncoderPart(OpenCLIPEncoder.Params),
        "hf-clip": EncoderPart(HFCLIPEncoder.Params),
        "classifier": EncoderPart(ClassifierParams),
    },
    heading="the image encoder and its parameters",
)
# the config's `encoder` section; its parameters' flat names join the stage's LEGACY
Encoder = ENCODER.tree(
    "openclip", __name__, doc="the image encoder; its parameters: encoder.<param>=value"
)


@dataclass(frozen=True)
class Config(StageConfig):
    # the folders under the runs root it names: plain names (core.config.check_plain_name)
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name", "encoder.classifier.run", "judge")
    LEGACY = legacy_names("annotate", ENCODER.legacy)
    SECTIONS = (ENCODER,)  # `encoder.model=ViT-B-16`: the picked encoder's (core.config)

    cpu_threads: int = 1  # pinned: CPU bytes must not depend on the launcher (StageConfig)
    encoder: Encoder = section(Encoder)
    # projection | similarity | ratio (docs/methods.md §2 and its ablations)
    annotator: str = "projection"
    sharpening: float = (
        4.0  # s in t_a = sigmoid(s (lambda_hat - 0.5)); presets set docs/methods.md's values
    )
    prototypes: str = "real"  # real: class means over real/train; text: zero-shot prompts
    # prototypes=real from the first N training images only (as train's train_limit: a fair
    # study's annotation sees the labels its classifiers see); 0 = all. Recorded only when set.
    train_limit: int = recorded_off_default(0)
    text_templates: tuple[str, ...] = ("a photo of a {}.",)
    batch_size: int = 256  # images per encoder forward
    workers: int = 2  # processes reading + decoding series shards ahead of the encoder (0: none)
    device: str = ""  # "" = this rank's accelerator (accelerate), else e.g. cpu, cuda:0
    # autocast dtype of the encoder forward: auto | fp32 | bf16 | fp16 (core/precision.py; auto:
    # bf16 on a bf16 GPU, fp32 on a CPU)
    precision: str = "fp32"
    series: str = ""  # series folder; "" = runs/<classes>/series
    # generator fidelity: a real-only classifier run under train/ classifies the series endpoints
    # (α = 0, 1); its accuracy there is written to annotation.json ("" = skip)
    judge: str = ""

    def __post_init__(self):
        check_choice("annotator", self.annotator, tuple(ANNOTATORS))
        check_choice("prototypes", self.prototypes, PROTOTYPE_SOURCES)
        check_precision("precision", self.precision)
        check_range("batch_size", self.batch_size, 1)
        check_range("workers", self.workers, 0)
        check_range("train_limit", self.train_limit, 0)
        if not self.sharpening > 0:
            raise ConfigError(f"sharpening={self.sharpening!r} must be > 0")
        if self.prototypes == "text" and self.encoder.name not in TEXT_ENCODERS:
            raise ConfigError(
                f"prototypes=text needs an encoder with a text tower ({', '.join(TEXT_ENCODERS)}); "
                f"encoder={self.encoder.name} has none"
            )
        if self.prototypes == "text" and (
            not self.text_templates or any("{}" not in t for t in self.text_templates)
        ):
            raise ConfigError("text_templates must each contain '{}' (the class name)")


PRESETS = stage_presets("annotate")
