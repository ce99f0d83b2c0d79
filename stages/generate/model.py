"""generate, part 2: the inputs and the generator (docs/methods.md §1).

Inputs are checked on every rank before anything is written. The backend is built from the config
without reading its weights (``lazy``): its ``metadata()`` is the identity recorded with every
image, known before the stage decides whether it has work left. Its weights are read on first use;
series whose images come out non-finite or blank are redone in float32 or the stage fails naming
them, so such images are never written.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import given_folder
from core.io import sha256_file
from core.logs import log
from core.precision import TORCH_NAMES, resolve_precision
from models.generators import (
    Generator,
    ModelNotFoundError,
    NonFiniteImageError,
    SeriesSpec,
    load_generator,
)
from models.generators.registry import generator_class
from shards.manifest import (
    Manifest,
    ShardError,
    is_complete,
    manifest_digest,
    read_manifest,
    remake_command,
)
from stages.configs.generate import Config
from stages.generate.plan import GenerationError
from stages.presets import edm_checkpoint

UNET_WEIGHTS = Path("unet") / "diffusion_pytorch_model.safetensors"  # save_unet's layout


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    real: Path
    class_names: tuple[str, ...]
    image_size: int
    generator: Path | None  # unet backend: the fit-generator folder
    generator_info: dict[str, Any]
    guidance: float = 1.0  # w, resolved once from guidance= (auto: the generator's recorded w)


def check_inputs(cfg: Config) -> Inputs:
    """Refuse bad input early, on every rank alike, before anything is written."""
    real = cfg.root / "real" / "train"
    real_m = read_manifest(real)
    size = cfg.image_size or int(real_m.info.get("image_size", 0))
    if size < 1:
        raise ShardError(f"{real}: the manifest names no image_size; set image_size=N")
    if cfg.backend.name == "edm":
        check_edm_model(cfg)
    if cfg.backend.name != "unet":
        return Inputs(real, real_m.class_names, size, None, {}, guidance(cfg, {}))
    folder, hint = generator_folder(cfg)
    if not is_complete(folder):
        raise GenerationError(f"no trained generator in {folder} (no manifest.json): {hint}")
    gen_m = read_manifest(folder)
    if gen_m.kind != "generator":
        raise GenerationError(f"{folder} holds a '{gen_m.kind}' folder, not a generator: {hint}")
    if gen_m.class_names != real_m.class_names:
        raise GenerationError(
            f"{folder} was trained on other classes ({', '.join(gen_m.class_names[:5])}, ...) "
            f"than {real} ({', '.join(real_m.class_names[:5])}, ...)"
        )
    check_generator_weights(folder, gen_m)
    if int(gen_m.info.get("image_size", size)) != size:
        raise GenerationError(
            f"{folder} makes {gen_m.info['image_size']}px images, {real} holds {size}px; "
            "set image_size= or retrain"
        )
    w = guidance(cfg, gen_m.info)
    if w != 1.0 and not gen_m.info.get("null_class", False):
        raise GenerationError(
            f"guidance={w:g}: the generator in {folder} has no null condition (fitted "
            "with label_dropout=0); use guidance=1, or refit it with fit-generator "
            "label_dropout=0.1"
        )
    return Inputs(real, real_m.class_names, size, folder, gen_m.info, w)


def check_edm_model(cfg: Config) -> None:
    """The edm backend's network must be there. No command in the hint: the .pkl's path is the
    user's to know, and a command a hint quotes must run as printed."""
    model, default = edm_model(cfg), cfg.root / "edm"
    if not model.exists():
        where = edm_checkpoint(cfg.preset) or "the EDM checkpoint of your dataset"
        raise GenerationError(
            f"EDM network {model} not found: download {where} and set model=<the .pkl>, or "
            f"convert it once into {default} (convert-edm with source=<the .pkl>)"
        )


def generator_folder(cfg: Config) -> tuple[Path, str]:
    """(the unet backend's fit-generator folder, what to do if it is not complete). A folder
    named by model= must exist (a typo is named as missing); the run root's own gets the
    command that makes it."""
    default = cfg.root / "generator"
    if cfg.model:
        hint = f"point model= at a folder fit-generator completed, or unset it for {default}"
        return given_folder("model", cfg.model, hint), hint
    remake = remake_command(default)
    how = f": `{remake[1]}`" if remake else ""
    return default, f"run fit-generator first{how} (or set model=<folder>)"


def check_generator_weights(folder: Path, manifest: Manifest) -> None:
    """The unet weights must be the very file fit-generator recorded (size and sha256): a
    missing, truncated or swapped file is refused in one line before diffusers reads it."""
    path = folder / UNET_WEIGHTS
    expected = manifest.info.get("weights_sha256")
    remake = remake_command(folder)
    fix = f"remove {folder} and rerun fit-generator" + (f": `{remake[1]}`" if remake else "")
    if not path.is_file():
        raise GenerationError(f"{path} is missing: {folder} is damaged; {fix}")
    if expected and sha256_file(path) != expected:
        raise GenerationError(
            f"{path}: sha256 differs from its manifest (truncated or replaced); {fix}"
        )


def upstream_digests(inputs: Inputs) -> dict[str, str]:
    """What series/ is built from: its manifest's `upstream`."""
    upstream = {"real": manifest_digest(inputs.real)}
    if inputs.generator is not None:
        upstream["generator"] = manifest_digest(inputs.generator)
    return upstream


def edm_model(cfg: Config) -> Path:
    """The edm backend's network: model=<folder or .pkl>, by default runs/<classes>/edm."""
    return Path(cfg.model) if cfg.model else cfg.root / "edm"


def resolve_dtype(cfg: Config, device: torch.device) -> str:
    """The generators' dtype word for `dtype=` (core/precision.py: auto = bf16 on a bf16 GPU,
    fp32 on a CPU); generate casts by itself, so no launcher has a say."""
    return TORCH_NAMES[resolve_precision("precision", cfg.precision, device, launcher=False)]


# ---------------------------------------------------------------- the generator


def guidance(cfg: Config, generator_info: dict[str, Any]) -> float:
    """guidance=auto: the unet generator's recorded w (fit-generator's best by fidelity; 1 for a
    generator without a null condition), 1 elsewhere; a number is used as given."""
    if cfg.guidance != "auto":
        return float(cfg.guidance)
    return float(generator_info.get("guidance", 1.0)) if cfg.backend.name == "unet" else 1.0


def clip_sample(cfg: Config, generator_info: dict[str, Any]) -> bool | None:
    """DDIM's x̂₀ clipping: clip_sample=on / off as given; auto = as fit-generator chose it with
    w (None: the saved scheduler config's)."""
    if cfg.clip_sample != "auto":
        return cfg.clip_sample == "on"
    return generator_info.get("clip_sample")


def _unet_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    # the weights' sha256 (fit-generator's manifest, checked in check_inputs) is their revision
    return {
        "model": inputs.generator,
        "revision": inputs.generator_info.get("weights_sha256"),
        "guidance": inputs.guidance,
        "clip_sample": clip_sample(cfg, inputs.generator_info),
    }


def _dit_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    ids = cfg.backend.dit.class_ids
    if len(ids) != len(inputs.class_names):
        raise GenerationError(
            f"backend.dit.class_ids lists {len(ids)} ImageNet ids for "
            f"{len(inputs.class_names)} classes: give one per class, in class order"
        )
    return {}


def _edm_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    return {"model": edm_model(cfg)}


# a built-in's arguments that only the stage knows (where the run root keeps its weights) or
# checks against the data (dit's one id per class); any other backend needs none
BACKEND_KWARGS: dict[str, Callable[[Config, Inputs], dict[str, Any]]] = {
    "unet": _unet_kwargs,
    "dit": _dit_kwargs,
    "edm": _edm_kwargs,
}


def data_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    """What the stage knows of the data, for a backend whose constructor names it."""
    return {
        "class_names": inputs.class_names,
        "num_classes": len(inputs.class_names),
        "image_size": inputs.image_size,
        "guidance": inputs.guidance,
    }


def generator_kwargs(cfg: Config, inputs: Inputs, device: torch.device) -> dict[str, Any]:
    """The backend's constructor arguments (all but dtype), the same way for every backend:
    those all share (models.generators.base.Shared), its own parameters (its `Params`, read from
    its leaves in the config's `backend` section: `cfg.backend.params()`), the data it names in
    its signature (`data_kwargs`), and a built-in's own (`BACKEND_KWARGS`)."""
    named = inspect.signature(generator_class(cfg.backend.name)).parameters
    shared = dict(
        model=cfg.model,
        revision=cfg.revision or None,
        sampler=cfg.sampler,
        steps=cfg.sample_steps,
        device=device,
        batch_size=cfg.batch_size,
        torch_compile=cfg.torch_compile,
    )
    data = {k: v for k, v in data_kwargs(cfg, inputs).items() if k in named}
    backend = cfg.backend.name
    own = BACKEND_KWARGS[backend](cfg, inputs) if backend in BACKEND_KWARGS else {}
    return shared | data | cfg.backend.params() | own


class Generators:
    """The backend in the run's dtype and its float32 twin for series that overflow in bf16/fp16.

    Both are built without their weights: ``metadata()`` reads none, ``get`` loads a dtype on
    first use (a resumed run with nothing left loads nothing).
    """

    def __init__(self, backend: str, kwargs: dict[str, Any], dtype: str):
        self.backend, self.kwargs, self.dtype = backend, kwargs, dtype
        self._built: dict[str, Generator] = {}
        self._loaded: dict[str, Generator] = {}

    def _build(self, dtype: str) -> Generator:
        if dtype not in self._built:
            self._built[dtype] = load_generator(self.backend, dtype=dtype, lazy=True, **self.kwargs)
        return self._built[dtype]

    def metadata(self) -> dict[str, Any]:
        """The identity of the run-dtype generator (``Generator.metadata()``), no weights read."""
        return self._build(self.dtype).metadata()

    def get(self, dtype: str) -> Generator:
        if dtype not in self._loaded:
            try:
                self._loaded[dtype] = self._build(dtype).load()
            except ModelNotFoundError as e:  # an OSError: make it the CLI's one-line error
                raise GenerationError(str(e)) from e
        return self._loaded[dtype]


def blank_series(images: torch.Tensor, specs: Sequence[SeriesSpec]) -> set[int]:
    """Ids of series with a constant image (all pixels equal): a failed sample, never data."""
    flat = images.flatten(2)
    blank = (flat.amax(dim=2) == flat.amin(dim=2)).any(dim=1)
    return {specs[i].series_id for i in torch.nonzero(blank).flatten().tolist()}


def _bad_series(gen: Generator, specs: Sequence[SeriesSpec], bar) -> tuple[torch.Tensor, set, set]:
    """(images, non-finite series ids, blank series ids)."""
    try:
        images, nonfinite = gen.generate_series(specs, progress=bar), set()
    except NonFiniteImageError as e:
        images, nonfinite = e.images, set(e.series_ids)
    return images, nonfinite, blank_series(images, specs) - nonfinite


def sample_series(gens: Generators, specs: Sequence[SeriesSpec], bar=None) -> torch.Tensor:
    """uint8 [n, K, H, W, 3]; series with non-finite or blank images are redone in float32
    (when the run is not float32 already) or raise GenerationError naming them."""
    images, nonfinite, blank = _bad_series(gens.get(gens.dtype), specs, bar)
    if (nonfinite or blank) and gens.dtype != "float32":
        redo = [s for s in specs if s.series_id in nonfinite | blank]
        log.warning(
            "generate: series %s gave non-finite/blank images in %s; redoing them in float32",
            sorted(nonfinite | blank),
            gens.dtype,
        )
        again, nonfinite, blank = _bad_series(gens.get("float32"), redo, None)
        row = {s.series_id: i for i, s in enumerate(specs)}
        for j, s in enumerate(redo):
            images[row[s.series_id]] = again[j]
    if nonfinite or blank:
        what = (f"non-finite pixels in series {sorted(nonfinite)}" if nonfinite else "") + (
            f"{'; ' if nonfinite else ''}blank (constant) images in series {sorted(blank)}"
            if blank
            else ""
        )
        raise GenerationError(
            f"{what} (float32); nothing was written for them: check the generator weights"
        )
    return images
