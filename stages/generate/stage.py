"""generate's run: check the inputs, plan the series, sample the shards of this rank, then
preview.png and, last, the manifest (the stage is described in stages/generate/__init__.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from core.launch import Processes
from core.logs import log, progress
from core.version import code_version
from shards.manifest import Manifest
from shards.writer import ShardFolder, completed, write_config
from stages.common.fidelity import cnn_judge
from stages.configs.generate import Config
from stages.generate.check import EndpointCheck, total_counts, write_counts
from stages.generate.model import (
    Generators,
    check_inputs,
    generator_kwargs,
    resolve_dtype,
    sample_series,
    upstream_digests,
)
from stages.generate.plan import make_plan
from stages.generate.series import series_info, shard_samples, write_preview


def endpoint_check(cfg: Config, device: torch.device) -> EndpointCheck | None:
    """The endpoint check of this run, its judge loaded (None when off)."""
    if cfg.endpoint.check == "off":
        return None
    judge = cnn_judge(cfg.root, cfg.endpoint.judge, device, key="endpoint.judge")
    return EndpointCheck(cfg.endpoint.check, judge, cfg.endpoint.tries)


def run(cfg: Config) -> Path:
    # 1. Inputs, plan and identity (every rank, before anything is written)
    inputs = check_inputs(cfg)
    plan = make_plan(cfg, len(inputs.class_names))
    # on a CPU-only machine accelerate sees torchrun ranks only with cpu=True
    procs = Processes(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    device = torch.device(cfg.device) if cfg.device else procs.device
    dtype = resolve_dtype(cfg, device)
    gens = Generators(cfg.backend.name, generator_kwargs(cfg, inputs, device), dtype)
    # what made the images: the generator's own identity (no weights read), plus the license
    # the user declares for them
    ident = gens.metadata() | {"license": cfg.license}
    out = cfg.root / "series"
    if completed(out, cfg.recorded(), upstream_digests(inputs)):  # a complete rerun only reads
        log.info("generate: %s is complete already", out)
        return out
    k = len(plan.alphas)
    log.info(
        "generate plan: %d %s, %d series x %d %s = %d images in %d shards of <= %d series; "
        "%s:%s, %s %d steps, guidance %g, %s, %d process(es) -> %s",
        len(plan.pairs), "pairs" if plan.k == 2 else f"{plan.k}-tuples", plan.num_series, k,
        "alphas" if plan.k == 2 else f"lattice points (m = {cfg.mixing.lattice_m})", plan.num_series * k, plan.num_shards,
        plan.series_per_shard, cfg.backend.name, ident["model_id"], cfg.sampler, cfg.sample_steps,
        ident["guidance"], dtype, procs.world, out,
    )  # fmt: skip
    if (out / "config.json").is_file():
        write_config(out, cfg.recorded())  # a different config is refused before any loading

    # 2. Load the model if this rank has work left, before writing anything: a model that fails
    #    to load leaves no folder behind, so the rerun with model=<folder> is not refused
    mine = procs.my_shards(plan.num_shards)
    folder = ShardFolder(out, prefix="series") if out.is_dir() else None
    if folder is None or any(folder.done(i) is None for i in mine):
        gens.get(dtype)
    if procs.is_main:
        write_config(out, cfg.recorded())
    folder = ShardFolder(out, prefix="series")

    # 3. My shards (i ≡ rank mod world); complete ones are skipped; series whose pure images
    #    fail the endpoint check are redrawn or dropped before their shard is written
    check = endpoint_check(cfg, device) if any(folder.done(i) is None for i in mine) else None
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
            if check is not None:
                specs, images, counts = check(lambda s: sample_series(gens, s), specs, images)
                write_counts(out, folder.path(i).name, counts)
            folder.write(i, shard_samples(plan, specs, images, inputs.class_names, ident))
    procs.barrier()
    if not procs.is_main:
        return out

    # 4. Preview, then the manifest last (rank 0, after every rank finished)
    write_preview(folder, plan, cfg.preview_series)
    info = series_info(cfg, plan, ident, inputs.image_size)
    if cfg.endpoint.check != "off":
        shards = [folder.path(i).name for i in range(plan.num_shards)]
        info["endpoint_check"] = total_counts(out, shards, cfg.endpoint.check, cfg.endpoint.judge)
    manifest: Manifest = folder.finish(
        plan.num_shards,
        kind="series",
        class_names=inputs.class_names,
        upstream=upstream_digests(inputs),
        code_version=code_version(),
        info=info,
    )
    log.info("generate: %d images in %d shards -> %s", manifest.num_samples, plan.num_shards, out)
    return out
