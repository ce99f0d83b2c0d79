"""Config of the `generate` stage: real/ (+ generator/ or a pretrained model) -> series/ (docs/methods.md §1).

The `backend` section picks the generator (models/generators/registry.GENERATORS) and holds
every backend's own parameters, derived from each backend's nested `Params` by the `BACKEND`
section (core/parts.py): `cfg.backend.name`, `cfg.backend.sd.native_size`. So `--set backend=sd
backend.native_size=512`, `backend.sd.native_size=512` and the flat `native_size=512`
(config.json's name, saying its path once) do the same thing, and a backend registered from
outside (pipeline/plugins.py) gets its leaves with no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from core.config import (
    ConfigError,
    StageConfig,
    check_choice,
    check_range,
    recorded_along,
    recorded_off_default,
)
from core.parts import Section
from core.precision import check_precision
from core.tree import section
from models.generators import GENERATORS
from stages.configs.legacy import legacy_names
from stages.presets import stage_presets

ENDPOINT_CHECKS = ("off", "redraw", "drop")
# the default of Mixing.alphas, for the alphas/lattice consistency check
DEFAULT_ALPHAS = 8
# the backends (the registry as any plugin left it) and their parameters
BACKEND = Section("backend", GENERATORS, heading="the generator and its parameters")
# the config's `backend` section; its parameters' flat names join the stage's LEGACY
Backend = BACKEND.tree(
    "unet", __name__, doc="the generator (models/generators); its parameters: backend.<param>=value"
)


@dataclass(frozen=True)
class Mixing:
    """the series planned: mixing ratios, classes per series, how many"""

    alphas: int = 8  # K mixing ratios per series, alpha_k = k/(K-1), endpoints included
    series_per_pair: int = 1
    pairs: int = 0  # 0 = every pair a < b; N = a seeded subset of N pairs
    # k-way mixing (docs/generate.md): a series = one noise at every point of the simplex lattice
    # w_i = n_i/m over k classes; k = 2, m = alphas - 1 is the CSM alpha grid above
    mix_classes: int = recorded_off_default(2)  # k classes per series
    lattice: int = recorded_off_default(0)  # m; 0 = alphas - 1
    # 0 = every k-subset; N = a seeded subset of N tuples
    # (k = 2: as pairs)
    tuples: int = recorded_off_default(0)
    series_per_tuple: int = recorded_off_default(0)  # 0 = series_per_pair
    limit: int = 0  # quick runs: only the first N series of the plan (0 = all)

    def __post_init__(self) -> None:
        check_range("mixing.alphas", self.alphas, 2)
        check_range("mixing.mix_classes", self.mix_classes, 2)
        for name in ("lattice", "tuples", "series_per_tuple", "pairs", "limit"):
            check_range(f"mixing.{name}", getattr(self, name), 0)
        check_range("mixing.series_per_pair", self.series_per_pair, 1)
        if self.pairs and self.mix_classes != 2:
            raise ConfigError(
                f"mixing.pairs={self.pairs} picks class pairs, but mixing.mix_classes="
                f"{self.mix_classes}: use mixing.tuples=N"
            )
        if self.pairs and self.tuples and self.pairs != self.tuples:
            raise ConfigError(
                f"mixing.pairs={self.pairs} and mixing.tuples={self.tuples} disagree; set one"
            )
        if self.lattice and self.alphas not in (DEFAULT_ALPHAS, self.lattice + 1):
            raise ConfigError(
                f"mixing.alphas={self.alphas} and mixing.lattice={self.lattice} disagree (the "
                "lattice m has m + 1 points per edge: alphas = lattice + 1); set one of them"
            )

    @property
    def lattice_m(self) -> int:
        """m of the simplex lattice (k = 2: K − 1 of the α grid)."""
        return self.lattice or self.alphas - 1

    @property
    def budget_per_tuple(self) -> int:
        return self.series_per_tuple or self.series_per_pair

    @property
    def subset(self) -> int:
        """N of a seeded subset of class tuples (0 = all)."""
        return self.tuples or self.pairs


@dataclass(frozen=True)
class Shards:
    """how the series are split into shards"""

    series_per_shard: int = 0  # 0 = auto: >= min_shards shards where the budget allows
    min_shards: int = 16  # >= 1 shard per process x data-loader worker downstream

    def __post_init__(self) -> None:
        check_range("shards.series_per_shard", self.series_per_shard, 0)
        check_range("shards.min_shards", self.min_shards, 1)


@dataclass(frozen=True)
class Endpoint:
    """fidelity-aware series (docs/generate.md)"""

    # a series whose pure images (α = 0, 1) the judge train/<judge> does not classify as their
    # classes is redrawn from a fresh noise (at most `tries` times, then dropped) or dropped at
    # once; off = as the paper
    check: str = recorded_off_default("off")
    # a real-only classifier run under train/
    # (the chains: encoder)
    judge: str = recorded_along("", "check")
    tries: int = recorded_along(3, "check")

    def __post_init__(self) -> None:
        check_choice("endpoint.check", self.check, ENDPOINT_CHECKS)
        check_range("endpoint.tries", self.tries, 1)
        if self.check != "off" and not self.judge:
            raise ConfigError(
                f"endpoint.check={self.check} needs endpoint.judge=<run>: a real-only "
                "classifier under train/ (e.g. the chain's encoder)"
            )


@dataclass(frozen=True)
class Config(StageConfig):
    # the folders under the runs root it names: plain names (core.config.check_plain_name)
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name", "endpoint.judge")
    LEGACY = legacy_names("generate", BACKEND.legacy)
    SECTIONS = (BACKEND,)  # `backend.native_size=512`: the picked backend's (core.config)

    cpu_threads: int = 1  # pinned: CPU bytes must not depend on the launcher (StageConfig)
    backend: Backend = section(Backend)
    # unet: "" = runs/<classes>/generator; sd/dit: hub id or local folder; edm: a folder written
    # by convert-edm ("" = runs/<classes>/edm) or an EDM .pkl (read without executing it)
    model: str = ""
    revision: str = ""  # hub revision of `model` ("" = the default branch)
    license: str = ""  # license of the generated images, recorded in the manifest ("" = unknown)
    sampler: str = (
        "ddim"  # deterministic only: ddim (eta 0) | dpmsolver++ | unipc; edm: heun | euler
    )
    sample_steps: int = 25
    # classifier-free guidance w (1 = none); auto = the unet generator's recorded best w
    # (fit-generator chooses it by fidelity), 1 for the other backends without a preset value
    guidance: float | Literal["auto"] = "auto"
    # DDIM's x̂₀ clipping (unet): auto = as fit-generator chose it with w, on | off override it
    # (the study tunes the (w, clipping) cell on val: pipeline/study/cells.py)
    clip_sample: str = recorded_off_default("auto")
    image_size: int = 0  # stored resolution; 0 = that of real/train
    mixing: Mixing = section(Mixing)
    shards: Shards = section(Shards)
    batch_size: int = 64  # images per model call; fixed: bytes must not depend on it
    device: str = ""  # "" = this rank's accelerator (accelerate), else e.g. cpu, cuda:0
    # auto | fp32 | bf16 | fp16 (core/precision.py; also "" = auto, float32, bfloat16, float16):
    # auto = bf16 on a bf16 GPU, fp32 on a CPU
    precision: str = ""
    torch_compile: bool = False  # torch.compile the denoiser (GPU; first batch compiles)
    preview_series: int = 8  # rows of preview.png
    endpoint: Endpoint = section(Endpoint)

    def __post_init__(self):
        backend = self.backend.name  # a registered one, and every backend's parameters checked
        entry = GENERATORS[backend]
        check_choice("sampler", self.sampler, sorted(entry.samplers))
        check_precision("precision", self.precision)
        for name in ("sample_steps", "batch_size"):
            check_range(name, getattr(self, name), 1)
        check_range("image_size", self.image_size, 0)
        check_range("preview_series", self.preview_series, 0)
        if self.guidance != "auto":
            if isinstance(self.guidance, bool) or not isinstance(self.guidance, int | float):
                raise ConfigError(
                    f"guidance={self.guidance!r} is not valid: a number w >= 0 or auto"
                )
            check_range("guidance", self.guidance, 0.0)
        check_choice("clip_sample", self.clip_sample, ["auto", "on", "off"])
        if self.clip_sample != "auto" and backend != "unet":
            raise ConfigError(
                f"clip_sample={self.clip_sample}: only the unet backend's DDIM sampler has x̂₀ "
                "clipping to set; leave it at auto"
            )
        if not entry.guidance and self.guidance not in ("auto", 1.0):
            raise ConfigError(
                f"guidance={self.guidance}: the {backend} backend has no classifier-free "
                "guidance; set guidance=1"
            )
        if entry.needs_model and not self.model:
            raise ConfigError(f"backend={backend} needs model=<hub id or local folder>")


PRESETS = stage_presets("generate")
