"""Config of the `generate` stage: real/ (+ generator/ or a pretrained model) -> series/ (METHODS §1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import ConfigError, StageConfig, check_choice, check_range
from models.generators import EDM_SAMPLERS, GENERATORS, SAMPLERS

ENDPOINT_CHECKS = ("off", "redraw", "drop")
DTYPES = ("", "float32", "bfloat16", "float16")  # "" = float32 on the CPU, bfloat16 on a GPU


@dataclass(frozen=True)
class Config(StageConfig):
    cpu_threads: int = 1  # pinned: CPU bytes must not depend on the launcher (StageConfig)
    backend: str = "unet"  # unet | sd | dit | edm (models.generators)
    # unet: "" = runs/<classes>/generator; sd/dit: hub id or local folder; edm: a folder written
    # by convert-edm ("" = runs/<classes>/edm) or an EDM .pkl (read without executing it)
    model: str = ""
    revision: str = ""  # hub revision of `model` ("" = the default branch)
    license: str = ""  # license of the generated images, recorded in the manifest ("" = unknown)
    sampler: str = "ddim"  # deterministic only: ddim (eta 0) | dpmsolver++; edm: heun | euler
    steps: int = 25
    # classifier-free guidance w (1 = none); auto = the unet generator's recorded best w
    # (fit-generator chooses it by fidelity), 1 for the other backends without a preset value
    guidance: str = "auto"
    prompt_template: str = "a photo of a {name}"  # sd
    negative_prompt: str = ""  # sd
    native_size: int = 0  # sd: generation resolution; 0 = the model's own (512 for SD 1.5)
    dit_class_ids: tuple[int, ...] = ()  # dit: ImageNet id of each of our classes, in order
    image_size: int = 0  # stored resolution; 0 = that of real/train
    alphas: int = 8  # K mixing ratios per series, alpha_k = k/(K-1), endpoints included
    series_per_pair: int = 1
    pairs: int = 0  # 0 = every pair a < b; N = a seeded subset of N pairs
    # k-way mixing (docs/generate.md): a series = one noise at every point of the simplex lattice
    # w_i = n_i/m over k classes; k = 2, m = alphas - 1 is the CSM alpha grid above
    mix_classes: int = 2  # k classes per series
    lattice: int = 0  # m; 0 = alphas - 1
    tuples: int = 0  # 0 = every k-subset; N = a seeded subset of N tuples (k = 2: as pairs)
    series_per_tuple: int = 0  # 0 = series_per_pair
    limit: int = 0  # quick runs: only the first N series of the plan (0 = all)
    series_per_shard: int = 0  # 0 = auto: >= min_shards shards where the budget allows
    min_shards: int = 16  # >= 1 shard per process x data-loader worker downstream
    batch_size: int = 64  # images per model call; fixed: bytes must not depend on it
    device: str = ""  # "" = this rank's accelerator (accelerate), else e.g. cpu, cuda:0
    dtype: str = ""  # "" = float32 on the CPU, bfloat16 on a GPU
    torch_compile: bool = False  # torch.compile the denoiser (GPU; first batch compiles)
    preview_series: int = 8  # rows of preview.png
    # fidelity-aware series (docs/generate.md): a series whose pure images (α = 0, 1) the judge
    # train/<endpoint_judge> does not classify as their classes is redrawn from a fresh noise
    # (at most endpoint_tries times, then dropped) or dropped at once; off = as the paper
    endpoint_check: str = "off"
    endpoint_judge: str = ""  # a real-only classifier run under train/ (the chains: encoder)
    endpoint_tries: int = 3

    def __post_init__(self):
        check_choice("backend", self.backend, sorted(GENERATORS))
        check_choice("sampler", self.sampler, sorted(EDM_SAMPLERS if self.edm else SAMPLERS))
        check_choice("dtype", self.dtype, DTYPES)
        check_range("alphas", self.alphas, 2)
        check_range("mix_classes", self.mix_classes, 2)
        for name in ("lattice", "tuples", "series_per_tuple"):
            check_range(name, getattr(self, name), 0)
        if self.pairs and self.mix_classes != 2:
            raise ConfigError(
                f"pairs={self.pairs} picks class pairs, but mix_classes={self.mix_classes}: "
                "use tuples=N"
            )
        if self.pairs and self.tuples and self.pairs != self.tuples:
            raise ConfigError(f"pairs={self.pairs} and tuples={self.tuples} disagree; set one")
        if self.lattice and self.alphas not in (DEFAULT_ALPHAS, self.lattice + 1):
            raise ConfigError(
                f"alphas={self.alphas} and lattice={self.lattice} disagree (the lattice m has "
                "m + 1 points per edge: alphas = lattice + 1); set one of them"
            )
        for name in ("steps", "series_per_pair", "min_shards", "batch_size"):
            check_range(name, getattr(self, name), 1)
        for name in ("pairs", "limit", "series_per_shard", "native_size", "image_size"):
            check_range(name, getattr(self, name), 0)
        check_range("preview_series", self.preview_series, 0)
        check_choice("endpoint_check", self.endpoint_check, ENDPOINT_CHECKS)
        check_range("endpoint_tries", self.endpoint_tries, 1)
        if self.endpoint_check != "off" and not self.endpoint_judge:
            raise ConfigError(
                f"endpoint_check={self.endpoint_check} needs endpoint_judge=<run>: a real-only "
                "classifier under train/ (e.g. the chain's encoder)"
            )
        if self.guidance != "auto":
            try:
                object.__setattr__(self, "guidance", float(self.guidance))
            except ValueError:
                raise ConfigError(
                    f"guidance={self.guidance!r} is not valid: a number w >= 0 or auto"
                ) from None
            check_range("guidance", self.guidance, 0.0)
        if self.backend == "edm" and self.guidance not in ("auto", 1.0):
            raise ConfigError(
                f"guidance={self.guidance}: the edm backend has no classifier-free guidance; "
                "set guidance=1"
            )
        if self.backend not in ("unet", "edm") and not self.model:
            raise ConfigError(f"backend={self.backend} needs model=<hub id or local folder>")
        if "{name}" not in self.prompt_template:
            raise ConfigError(
                f"prompt_template must contain '{{name}}', got {self.prompt_template!r}"
            )

    @property
    def edm(self) -> bool:
        return self.backend == "edm"

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

    def to_dict(self) -> dict[str, Any]:
        """The k-way fields are recorded only when set, the endpoint check's only when it is on:
        a 2-way config.json stays the very file the 2-way code wrote (so its folders still
        resume)."""
        d = super().to_dict()
        for name, default in K_WAY_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        if self.endpoint_check == "off":  # the same: a folder made before the check resumes
            for name in ENDPOINT_FIELDS:
                del d[name]
        return d


DEFAULT_ALPHAS = 8  # the default of Config.alphas, for the alphas/lattice consistency check
K_WAY_DEFAULTS = {"mix_classes": 2, "lattice": 0, "tuples": 0, "series_per_tuple": 0}
ENDPOINT_FIELDS = ("endpoint_check", "endpoint_judge", "endpoint_tries")


# Pretrained text-to-image model of the photo presets; a local save_pretrained folder works too
# (model=/path). Generated at 512x512 and resized to the dataset's resolution (METHODS §1).
SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"
DIT_XL_256 = "facebook/DiT-XL-2-256"  # the imagenet preset's class-conditional generator
_SD = dict(backend="sd", model=SD15, steps=25, guidance=7.5, batch_size=16)


def _edm(steps: int) -> dict:
    """`--set backend=edm` on a photo preset: the paper's EDM sampling (METHODS §1): Heun,
    σ 0.002..80, ρ 7, no guidance; the EDM networks are CC BY-NC-SA 4.0."""
    edm = dict(model="", sampler="heun", steps=steps, guidance=1.0, batch_size=256)
    return {"backend=edm": edm | dict(license="cc-by-nc-sa-4.0")}


PRESETS = {
    # the in-house UNet of fit-generator; 45 pairs x 6 = 270 series, 2160 images (~1.5 min, 2 cores)
    # DDIM 15: on the fresh-clone chain as faithful as 25 (99.1 % vs 95.9 % of the pure images
    # their digit, the fit's own check chose w = 2) in 60 % of the time (docs/generate.md)
    "digits": dict(
        backend="unet", steps=15, series_per_pair=6, batch_size=64, endpoint_judge="encoder"
    ),
    # METHODS §1 reference budgets: 444 / 4 / 2 series per pair (about 160k / 158k / 318k images)
    # the in-house 28x28 UNet; 45 pairs x 16 = 720 series, 5,760 images (~15 CPU minutes)
    "fashion-mnist": dict(
        backend="unet", steps=25, series_per_pair=16, batch_size=64, endpoint_judge="encoder"
    ),
    # `--set backend=edm` switches to the paper's EDM networks with its 20 / 25 / 25 Heun steps
    "cifar10": dict(_SD, series_per_pair=444, when=_edm(20)),
    "cifar100": dict(_SD, series_per_pair=4, when=_edm(25)),
    "tiny-imagenet": dict(_SD, series_per_pair=2, when=_edm(25)),
    "imagefolder": dict(_SD, series_per_pair=4),
    # ImageNet-1k: DiT-XL/2 is class-conditional on these very 1,000 classes (our class i, the
    # i-th sorted wnid, is its label i), 256 px, stored at real/'s resolution. CSM's budget of
    # ~3x the real training set: 1 series per pair = 499,500 series, 3,996,000 images. No
    # guidance, as CSM (DiT's usual 1.5-4 is `--set guidance=...`); DDIM 50 steps.
    "imagenet": dict(
        backend="dit",
        model=DIT_XL_256,
        dit_class_ids=tuple(range(1000)),
        steps=50,
        guidance=1.0,
        series_per_pair=1,
        batch_size=64,
    ),
}
