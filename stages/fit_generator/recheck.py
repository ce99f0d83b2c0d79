"""fit-generator on a finished fit whose config differs only in what its fidelity check tries.

The guidance grid and the x̂₀-clipping choice decide how the generator is *sampled*, not its
weights. Changing them on a finished fit (a grid extended because the chosen w sat on its edge;
`clip_choice` turned on) redoes the last point of the fidelity curve with the new grid on the
saved weights, chooses again with the same judge, and writes the folder anew: minutes, where a
refit takes the whole fit. The earlier points of the curve stay as they were checked.

The new folder is built beside the old one (its unchanged files hard-linked, every rewritten file
a new one, the manifest last) and then takes its name, so the old folder is never half-changed
and a killed recheck leaves it as it was. The manifest's digest changes, so generate sees a new
generator and draws its series again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from core.codec import CONFIG_JSON, path
from core.io import atomic_write_json, canonical_json, read_json
from core.logs import log
from core.version import code_version
from models.generators import load_generator
from shards.manifest import MANIFEST, Manifest, is_complete, read_manifest, write_manifest
from shards.writer import NOT_IDENTITY
from stages.common.fidelity import FidelityCheck, make_judges, sample_grid
from stages.configs.fit_generator import Config

# the leaves a finished fit is rechecked for instead of refused (how it is sampled)
RECHECK_FIELDS = frozenset({"fidelity.guidance_grid", "fidelity.clip_choice", "fidelity.samplers"})


def fidelity_check(cfg: Any, names: list[str], device: Any) -> FidelityCheck:
    """fit-generator's fidelity check as its config asks: its judges (trained on the same
    labelled budget, train_limit), the guidance grid, clipping and sampler cells; one builder
    for the fit and for a recheck of a finished fit."""
    judges = make_judges(
        cfg.root, cfg.fidelity.judge, device, cfg.train_limit, cfg.fidelity.report_judges
    )
    return FidelityCheck(
        judges,
        cfg.checked_guidance_grid,
        names,
        cfg.seed,
        cfg.fidelity.per_class,
        cfg.fidelity.clip_choice,
        cfg.fidelity.samplers,
    )


def recheck_fields(folder: Path, config: dict[str, Any]) -> set[str] | None:
    """The leaves (by path) in which `config` (what config.json records) differs from the
    finished fit in `folder` when they are all RECHECK_FIELDS (then a recheck makes the folder
    this config's); None otherwise (no finished fit, the same config, or another difference,
    a key no leaf has now included: the usual config check decides)."""
    if not is_complete(folder) or not (folder / CONFIG_JSON).is_file():
        return None
    old = read_json(folder / CONFIG_JSON)
    new = json.loads(canonical_json({k: v for k, v in config.items() if k not in NOT_IDENTITY}))
    changed = {path(Config, k) for k in set(old) | set(new) if old.get(k) != new.get(k)}
    return changed if changed and changed <= RECHECK_FIELDS else None


def recheck(cfg: Any, folder: Path, config: dict[str, Any], names: tuple[str, ...], procs) -> Path:
    """Redo the last fidelity point of the fit in `folder` with `cfg`'s grid, choose again, and
    replace the folder by one with this `config` (module docstring). The main process does it;
    the others have nothing to do."""
    if not procs.is_main:
        return folder
    device = procs.device
    old = read_manifest(folder)
    fidelity = read_json(folder / "fidelity.json")
    step = fidelity["curve"][-1]["step"]
    log.info(
        "fit-generator: %s is fitted; its check changed (%s): checking step %d again with the "
        "new grid, the weights stay", folder, ", ".join(sorted(recheck_fields(folder, config) or ())),
        step,
    )  # fmt: skip
    check = fidelity_check(cfg, names, device)
    gen = load_generator("unet", model=folder, steps=cfg.preview.sample_steps, device=device)
    curve = [*fidelity["curve"][:-1], check(gen, step)]
    guidance, clip, summary = check.choose(curve)

    tmp, gone = folder.with_name(folder.name + ".recheck"), folder.with_name(folder.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(gone, ignore_errors=True)
    shutil.copytree(folder, tmp, copy_function=os.link)  # every write below makes a new file
    (tmp / MANIFEST).unlink()
    atomic_write_json(tmp / CONFIG_JSON, {k: v for k, v in config.items() if k not in NOT_IDENTITY})
    check.write(tmp, curve, guidance, clip)
    sample_grid(
        tmp,
        names,
        device,
        guidance,
        cfg.preview.sample_steps,
        cfg.preview.per_class,
        cfg.seed,
        clip,
    )
    info = {k: v for k, v in old.info.items() if k != "clip_sample"}
    info.update(
        guidance=guidance, fidelity=summary, **({} if clip is None else {"clip_sample": clip})
    )
    write_manifest(
        tmp,
        Manifest(
            kind=old.kind,
            class_names=old.class_names,
            shards=(),
            upstream=old.upstream,
            code_version=code_version(),
            info=info,
        ),
    )
    os.rename(folder, gone)
    os.rename(tmp, folder)
    shutil.rmtree(gone)
    what = f"w = {guidance:g}" + ("" if clip is None else f", clipping {'on' if clip else 'off'}")
    log.info(
        "fit-generator: rechecked %s: chosen %s (was w = %g)", folder, what, old.info["guidance"]
    )
    return folder
