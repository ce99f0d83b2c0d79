"""generate: real/ (+ generator/ or a pretrained model) -> runs/<classes>/series/ (METHODS §1).

    python -m pipeline generate --preset digits
    python -m pipeline generate --preset cifar100 --set model=/models/sd-v1-5 limit=64
    accelerate launch --multi_gpu -m pipeline generate --preset cifar10

CSM series: every unordered pair a < b, walked in order and cycled until the budget
(``series_per_pair`` per pair) is used; series s takes pair s mod P, its noise seed is
derive_seed(seed, "series", s), and its K images have α_k = k/(K−1) (α = weight of class a).
With mix_classes = k ≥ 3 the pairs become every k-subset (same walk) and the α grid the simplex
lattice w = n/m (models/simplex.py); k = 2 is the 2-way case, byte for byte. The
plan depends on the config only, so ids, seeds, shards and bytes never depend on the number of
processes, the batch size or the resume point.

Shards hold whole series. Under N processes rank r writes shards i ≡ r (mod N); complete shards
are skipped (resume); rank 0 writes preview.png and, last, manifest.json after all ranks finished.
Non-finite or blank images are never written: their series are redone in float32, or the stage
fails naming them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.generators import (
    EDM_CHECKPOINTS,
    Generator,
    MixSpec,
    ModelNotFoundError,
    NonFiniteImageError,
    SeriesSpec,
    load_generator,
)
from models.simplex import class_tuples, lattice_weights
from pipeline.configs.generate import Config
from pipeline.plots import image_grid
from pipeline.runtime import Processes, code_version, derive_seed, log, make_generator, progress
from shards.io import sha256_file
from shards.manifest import Manifest, ShardError, manifest_digest, read_manifest
from shards.reader import iter_shard
from shards.writer import ShardFolder, completed, write_config

MAX_SHARD_IMAGES = 1000  # auto shard size: small enough to resume and to spread over GPUs


UNET_WEIGHTS = Path("unet") / "diffusion_pytorch_model.safetensors"  # save_unet's layout


class GenerationError(ValueError):
    """Series that cannot be generated cleanly (non-finite or blank images), or a missing model."""


# ---------------------------------------------------------------- 1. the plan


@dataclass(frozen=True)
class Plan:
    """Which series exist, with which classes, noise and shard (a pure function of the config).

    ``pairs`` are the class tuples in walk order (pairs for k = 2); ``alphas`` the positions of a
    series: α of class a for k = 2, the weight vector w (length k) of the lattice point for k ≥ 3.
    """

    pairs: tuple[tuple[int, ...], ...]
    alphas: tuple[float, ...] | tuple[tuple[float, ...], ...]
    num_series: int
    series_per_shard: int
    seed: int

    @property
    def k(self) -> int:
        return len(self.pairs[0])

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num_series / self.series_per_shard)

    def shard_series(self, shard: int) -> range:
        start = shard * self.series_per_shard
        return range(start, min(start + self.series_per_shard, self.num_series))

    def spec(self, series: int) -> SeriesSpec | MixSpec:
        """Series s: tuple s mod P (the walk cycles over the tuples), its own noise seed."""
        classes = self.pairs[series % len(self.pairs)]
        seed = derive_seed(self.seed, "series", series)
        if self.k == 2:
            return SeriesSpec(series, *classes, self.alphas, seed)
        return MixSpec(series, classes, self.alphas, seed)


def make_plan(cfg: Config, num_classes: int) -> Plan:
    k, what = cfg.mix_classes, "pairs" if cfg.mix_classes == 2 else f"{cfg.mix_classes}-tuples"
    every = class_tuples(num_classes, k)  # k = 2: every a < b in order
    if not every:
        raise GenerationError(f"{num_classes} class(es): series need at least {k} classes")
    if cfg.subset > len(every):
        raise GenerationError(
            f"{'pairs' if cfg.pairs else 'tuples'}={cfg.subset}: only {len(every)} {what} among "
            f"{num_classes} classes (0 = all)"
        )
    pairs = every
    if cfg.subset:  # a seeded subset, kept in walk order
        pick = torch.randperm(len(every), generator=make_generator(cfg.seed, "pairs"))
        pairs = [every[i] for i in sorted(pick[: cfg.subset].tolist())]
    n = cfg.budget_per_tuple * len(pairs)
    if cfg.limit:
        n = min(n, cfg.limit)
    m = cfg.lattice_m
    # k = 2: α_j = j/(K−1), the 2-way grid; k >= 3: every point of the simplex lattice
    alphas = tuple(i / m for i in range(m + 1)) if k == 2 else lattice_weights(k, m)
    per_shard = cfg.series_per_shard or max(
        1, min(math.ceil(n / cfg.min_shards), MAX_SHARD_IMAGES // len(alphas))
    )
    return Plan(tuple(pairs), alphas, n, per_shard, cfg.seed)


# ---------------------------------------------------------------- 2. the generator


@dataclass(frozen=True)
class Inputs:
    real: Path
    class_names: tuple[str, ...]
    image_size: int
    generator: Path | None  # unet backend: the fit-generator folder
    generator_info: dict[str, Any]


def check_inputs(cfg: Config) -> Inputs:
    """Refuse bad input early, on every rank alike, before anything is written."""
    real = cfg.root / "real" / "train"
    real_m = read_manifest(real)
    size = cfg.image_size or int(real_m.info.get("image_size", 0))
    if size < 1:
        raise ShardError(f"{real}: the manifest names no image_size; set image_size=N")
    if cfg.backend == "edm" and not edm_model(cfg).exists():
        where = EDM_CHECKPOINTS.get(cfg.preset, "the EDM checkpoint of your dataset")
        raise GenerationError(
            f"EDM network {edm_model(cfg)} not found: download {where} and set model=<the .pkl>, "
            "or convert it once with `python -m pipeline convert-edm --set source=<the .pkl> "
            f"dest={edm_model(cfg)}`"
        )
    if cfg.backend != "unet":
        return Inputs(real, real_m.class_names, size, None, {})
    folder = Path(cfg.model) if cfg.model else cfg.root / "generator"
    hint = f"run `python -m pipeline fit-generator --preset {cfg.preset}` first (or set model=<folder>)"
    if not (folder / "manifest.json").is_file():
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
    return Inputs(real, real_m.class_names, size, folder, gen_m.info)


def check_generator_weights(folder: Path, manifest: Manifest) -> None:
    """The unet weights must be the very file fit-generator recorded (size and sha256): a
    missing, truncated or swapped file is refused in one line before diffusers reads it."""
    path = folder / UNET_WEIGHTS
    expected = manifest.info.get("weights_sha256")
    if not path.is_file():
        raise GenerationError(f"{path} is missing: {folder} is damaged; rerun fit-generator")
    if expected and sha256_file(path) != expected:
        raise GenerationError(
            f"{path}: sha256 differs from its manifest (truncated or replaced); rerun fit-generator"
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
    return cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def identity(cfg: Config, inputs: Inputs, dtype: str) -> dict[str, Any]:
    """What made the images, known without loading the model (a resume may load none).

    No absolute paths: a local folder is named by its last component; the unet's revision is its
    weights' sha256.
    """
    if inputs.generator is not None:
        model_id = f"{inputs.generator.parent.name}/{inputs.generator.name}"
        revision = inputs.generator_info.get("weights_sha256")
    elif cfg.backend == "edm":  # a local folder or .pkl: its name only
        model_id, revision = edm_model(cfg).name, cfg.revision or None
    else:
        model_id = Path(cfg.model).name if Path(cfg.model).is_dir() else cfg.model
        revision = cfg.revision or None
    ident = {
        "backend": cfg.backend,
        "model_id": model_id,
        "revision": revision,
        "sampler": cfg.sampler,
        "steps": cfg.steps,
        "guidance": cfg.guidance,
        "license": cfg.license,
        "dtype": dtype,
    }
    extras = {
        "sd": {"prompt_template": cfg.prompt_template, "negative_prompt": cfg.negative_prompt},
        "dit": {"class_ids": list(cfg.dit_class_ids)},
    }
    return ident | extras.get(cfg.backend, {})


def _unet_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    return {"model": inputs.generator}


def _sd_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    return {
        "model": cfg.model,
        "class_names": inputs.class_names,
        "image_size": inputs.image_size,
        "revision": cfg.revision or None,
        "prompt_template": cfg.prompt_template,
        "negative_prompt": cfg.negative_prompt,
        "guidance": cfg.guidance,
        "native_size": cfg.native_size or None,
    }


def _dit_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    if len(cfg.dit_class_ids) != len(inputs.class_names):
        raise GenerationError(
            f"dit_class_ids lists {len(cfg.dit_class_ids)} ImageNet ids for "
            f"{len(inputs.class_names)} classes: give one per class, in class order"
        )
    return {
        "model": cfg.model,
        "class_ids": cfg.dit_class_ids,
        "guidance": cfg.guidance,
        "image_size": inputs.image_size,
        "revision": cfg.revision or None,
    }


def _edm_kwargs(cfg: Config, inputs: Inputs) -> dict[str, Any]:
    return {
        "model": edm_model(cfg),
        "num_classes": len(inputs.class_names),
        "image_size": inputs.image_size,
    }


BACKEND_KWARGS: dict[str, Callable[[Config, Inputs], dict[str, Any]]] = {
    "unet": _unet_kwargs,
    "sd": _sd_kwargs,
    "dit": _dit_kwargs,
    "edm": _edm_kwargs,
}


class Generators:
    """The backend, loaded on first use (a resumed run with nothing left loads nothing), and its
    float32 twin for series that overflow in bf16/fp16."""

    def __init__(self, backend: str, kwargs: dict[str, Any], dtype: str):
        self.backend, self.kwargs, self.dtype = backend, kwargs, dtype
        self._loaded: dict[str, Generator] = {}

    def get(self, dtype: str) -> Generator:
        if dtype not in self._loaded:
            try:
                self._loaded[dtype] = load_generator(self.backend, dtype=dtype, **self.kwargs)
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


# ---------------------------------------------------------------- 3. shards


def _mixing_fields(plan: Plan, spec, k: int, names) -> tuple[dict[str, Any], int]:
    """(json fields naming the mix of position k, the dominant class).

    k = 2 keeps the 2-way fields (classes [a, b], alpha = weight of a); k ≥ 3 writes classes
    and weights of length k. Dominant = highest weight, the first class on ties (α = 0.5: a).
    """
    if plan.k == 2:
        a, b, alpha = spec.class_a, spec.class_b, plan.alphas[k]
        fields = {"classes": [a, b], "names": [names[a], names[b]], "alpha": alpha}
        return fields, (a if alpha >= 0.5 else b)
    w = plan.alphas[k]
    fields = {
        "classes": list(spec.classes),
        "names": [names[c] for c in spec.classes],
        "weights": list(w),
    }
    return fields, spec.classes[max(range(len(w)), key=lambda i: (w[i], -i))]


def sample_key(series: int, position: int, positions: int) -> str:
    """s0000042_03: series id, position (two digits, more when a series has > 100 images)."""
    return f"s{series:07d}_{position:0{max(2, len(str(positions - 1)))}d}"


def shard_samples(
    plan: Plan, specs: Sequence[SeriesSpec], images: torch.Tensor, names, ident: dict
) -> list[dict[str, Any]]:
    """Sample dicts of one shard; the json field set is identical in every sample."""
    generator = f"{ident['backend']}:{ident['model_id']}"
    samples = []
    for spec, series in zip(specs, images.numpy()):
        for k in range(len(plan.alphas)):
            mix, dominant = _mixing_fields(plan, spec, k, names)
            meta = {
                "series": spec.series_id,
                "position": k,
                **mix,
                "seed": spec.seed,
                "generator": generator,
                "revision": ident["revision"],
                "sampler": ident["sampler"],
                "steps": ident["steps"],
                "guidance": ident["guidance"],
            }
            samples.append(
                {
                    "__key__": sample_key(spec.series_id, k, len(plan.alphas)),
                    "png": series[k],
                    "cls": dominant,
                    "json": meta,
                }
            )
    return samples


def write_preview(folder: ShardFolder, plan: Plan, n_series: int) -> None:
    """preview.png from the written shards (rows = series, columns = α), whoever wrote them.

    Rows are series spread over the first pass of the pair walk, so they show different pairs
    rather than (0, 1), (0, 2), ... only.
    """
    k = len(plan.alphas)
    first_pass = min(len(plan.pairs), plan.num_series)
    step = max(1, first_pass // max(n_series, 1))
    wanted = list(range(0, first_pass, step))[:n_series]
    images: dict[int, list[np.ndarray]] = {s: [None] * k for s in wanted}
    names: dict[int, str] = {}
    for shard in sorted({s // plan.series_per_shard for s in wanted}):
        for sample in iter_shard(folder.path(shard)):
            meta = sample["meta"]
            if meta["series"] in images:
                images[meta["series"]][meta["position"]] = sample["image"]
                # reads left to right: α = 0 is pure b (k ≥ 3: position 0 is the last class)
                names[meta["series"]] = ">".join(reversed(meta["names"]))
    if plan.k == 3:
        return write_triangles(
            folder, plan, [images[s] for s in wanted], [names[s] for s in wanted]
        )
    rows = [im for s in wanted for im in images[s]]
    labels = [names[s] for s in wanted]
    n = min(n_series, len(rows) // k)
    if n == 0:
        return
    grid = np.stack(rows[: n * k]).reshape(n, k, *rows[0].shape)
    image_grid(
        grid,
        folder.folder / "preview.png",
        row_labels=labels[:n],
        col_labels=[f"{a:.2f}" for a in plan.alphas] if plan.k == 2 else [],
        scale=max(1, 64 // rows[0].shape[0]),
    )


def write_triangles(folder: ShardFolder, plan: Plan, series: list, names: list[str]) -> None:
    """k = 3 preview: each series as a triangle of its lattice (row i: n_1 = m − i, column j:
    n_3 = j), so the pure classes sit at the corners: c_1 top left, c_2 bottom left, c_3
    bottom right. Series side by side (at most 4), labelled c_3>c_2>c_1 on the left."""
    if not series:
        return
    m = round(1 / min(w for point in plan.alphas for w in point if w > 0))
    where = {tuple(round(w * m) for w in point): p for p, point in enumerate(plan.alphas)}
    series, names = series[:4], names[:4]
    blank = np.full_like(series[0][0], 255)
    grid = np.stack(
        [
            np.stack(
                [
                    s[where[(m - i, i - j, j)]] if j <= i else blank
                    for s in series
                    for j in range(m + 1)
                ]
            )
            for i in range(m + 1)
        ]
    )
    image_grid(
        grid,
        folder.folder / "preview.png",
        row_labels=[" | ".join(names)] + [""] * m,
        scale=max(1, 64 // series[0][0].shape[0]),
    )


# ---------------------------------------------------------------- the stage


def run(cfg: Config) -> Path:
    # 1. Inputs, plan and identity (every rank, before anything is written)
    inputs = check_inputs(cfg)
    plan = make_plan(cfg, len(inputs.class_names))
    # on a CPU-only machine accelerate sees torchrun ranks only with cpu=True
    procs = Processes(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    device = torch.device(cfg.device) if cfg.device else procs.device
    dtype = resolve_dtype(cfg, device)
    ident = identity(cfg, inputs, dtype)
    kwargs = BACKEND_KWARGS[cfg.backend](cfg, inputs)
    kwargs |= dict(
        sampler=cfg.sampler,
        steps=cfg.steps,
        device=device,
        batch_size=cfg.batch_size,
        torch_compile=cfg.torch_compile,
    )
    gens = Generators(cfg.backend, kwargs, dtype)
    out = cfg.root / "series"
    if completed(out, cfg.to_dict(), upstream_digests(inputs)):  # a complete rerun only reads
        log.info("generate: %s is complete already", out)
        return out
    k = len(plan.alphas)
    log.info(
        "generate plan: %d %s, %d series x %d %s = %d images in %d shards of <= %d series; "
        "%s:%s, %s %d steps, guidance %g, %s, %d process(es) -> %s",
        len(plan.pairs), "pairs" if plan.k == 2 else f"{plan.k}-tuples", plan.num_series, k,
        "alphas" if plan.k == 2 else f"lattice points (m = {cfg.lattice_m})", plan.num_series * k, plan.num_shards,
        plan.series_per_shard, cfg.backend, ident["model_id"], cfg.sampler, cfg.steps,
        cfg.guidance, dtype, procs.world, out,
    )  # fmt: skip
    if (out / "config.json").is_file():
        write_config(out, cfg.to_dict())  # a different config is refused before any loading

    # 2. Load the model if this rank has work left, before writing anything: a model that fails
    #    to load leaves no folder behind, so the rerun with model=<folder> is not refused
    mine = procs.my_shards(plan.num_shards)
    folder = ShardFolder(out, prefix="series") if out.is_dir() else None
    if folder is None or any(folder.done(i) is None for i in mine):
        gens.get(dtype)
    if procs.is_main:
        write_config(out, cfg.to_dict())
    folder = ShardFolder(out, prefix="series")

    # 3. My shards (i ≡ rank mod world); complete ones are skipped
    total = sum(len(plan.shard_series(i)) for i in mine) * k
    with progress(
        range(total), total=total, desc="generate", unit="img", enabled=procs.is_main
    ) as bar:
        for i in mine:
            specs = [plan.spec(s) for s in plan.shard_series(i)]
            if folder.done(i) is not None:
                bar.update(len(specs) * k)
                continue
            images = sample_series(gens, specs, bar.update)
            folder.write(i, shard_samples(plan, specs, images, inputs.class_names, ident))
    procs.barrier()
    if not procs.is_main:
        return out

    # 4. Preview, then the manifest last (rank 0, after every rank finished)
    write_preview(folder, plan, cfg.preview_series)
    upstream = upstream_digests(inputs)
    info = {
        "generator": ident,
        "alphas": list(plan.alphas),
        "series_per_pair": cfg.series_per_pair,
        "num_series": plan.num_series,
        "num_pairs": len(plan.pairs),
        "image_size": inputs.image_size,
    }
    if plan.k > 2:  # k-way: the lattice instead of the α grid
        del info["alphas"], info["series_per_pair"], info["num_pairs"]
        info |= {
            "mix_classes": plan.k,
            "lattice": cfg.lattice_m,
            "weights": [list(w) for w in plan.alphas],
            "series_per_tuple": cfg.budget_per_tuple,
            "num_tuples": len(plan.pairs),
        }
    manifest: Manifest = folder.finish(
        plan.num_shards,
        kind="series",
        class_names=inputs.class_names,
        upstream=upstream,
        code_version=code_version(),
        info=info,
    )
    log.info("generate: %d images in %d shards -> %s", manifest.num_samples, plan.num_shards, out)
    return out
