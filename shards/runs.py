"""Run folders on disk (`train/<run>/`, `finetune/<run>/`): trained weights and their manifest.

A run folder holds `model.safetensors` (the classifier's state dict), `model.json`, the stage's
`metrics.json` and plots, and `manifest.json`, written last: the one completion rule of every
semix output. A folder without a manifest is incomplete and no reader accepts it; once it has
one, nothing in it changes (a rerun only reads, later stages write their own folders).

Everything the manifest pins is a function of the config, the inputs and the code: the same run
on two machines writes the same bytes. What depends on the machine (the data path its free
memory chose, seconds per epoch) goes to `host.json` (HOST), which the manifest leaves out.

`model.json` says how to rebuild the network and feed it:
    {"arch": <Classifier.arch_config()>, "class_names": [...], "image_size": int,
     "normalize": {"mean": [...], "std": [...]}, ...anything else the writer adds}
The manifest (`shards.manifest.Manifest`, kind "run", no shards) records the weights' sha256,
the sha256 of every other file of the run, the upstream manifest digests the run was made from
(`real/train`, `real/val`, `mixed`, `init`) and the code version. Weights are safetensors:
loading never unpickles anything, and `read_run(...).state_dict()` checks their sha256.

    run = read_run(folder)                        # refuses an incomplete run in one line
    model, meta = load_model(folder, build)        # build(meta["arch"]) -> nn.Module
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save_file
from torch import nn

from core.io import (
    atomic_write_json,
    read_json,
    sha256_bytes,
    sha256_file,
    tmp_path_for,
    writing,
)
from core.precision import FROM_ACCELERATE
from core.version import code_version
from shards.manifest import (
    MANIFEST,
    Manifest,
    ShardError,
    is_complete,
    manifest_digest,
    read_manifest,
    remake_command,
    write_manifest,
)

WEIGHTS = "model.safetensors"
META = "model.json"
RUN_KIND = "run"
# The machine's facts about a run (how it was read, how long it took): written next to the
# outputs, never pinned by the manifest, so a run's identity does not depend on where it ran.
HOST = "host.json"
HOST_FIELDS = ("seconds", "images_per_s")  # per-epoch history entries that go to HOST


class RunError(ShardError):
    """A run folder is missing, incomplete, damaged, not a run, or made from other inputs: named
    for what failed, a ShardError for every `except ShardError` and the CLI's exit 1."""


def split_history(
    history: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the per-epoch history without the machine's timings, for metrics.json; the timings,
    [{epoch, seconds, images_per_s}], for host.json)."""
    kept = [{k: v for k, v in h.items() if k not in HOST_FIELDS} for h in history]
    timing = [{"epoch": h.get("epoch")} | {k: h[k] for k in HOST_FIELDS if k in h} for h in history]
    return kept, timing


def write_host(
    folder: Path, data_path: Mapping[str, Any], history: list[dict[str, Any]], mixed: str = ""
) -> None:
    """host.json: the precision the run computes in (`mixed`: accelerate's word, "no" | "bf16" |
    "fp16", as "fp32" | "bf16" | "fp16": what `precision=auto` became on this machine or under
    accelerate launch), the data path this machine chose (path, decoded and budget bytes) and
    each epoch's seconds. Rewritten with metrics.json while training; never in the manifest."""
    precision = {"precision": FROM_ACCELERATE.get(mixed, mixed)} if mixed else {}
    record = {**precision, "data_path": dict(data_path), "epochs": split_history(history)[1]}
    atomic_write_json(Path(folder) / HOST, record)


# ---------------------------------------------------------------- writing


def write_weights(
    folder: Path, state_dict: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> str:
    """model.safetensors, then model.json; returns the weights' sha256. The run is complete only
    once `finish_run` has written its manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    tmp = tmp_path_for(folder / WEIGHTS)
    with writing(folder / WEIGHTS, tmp):  # safetensors' own I/O errors name the weights too
        save_file(tensors, str(tmp))
        tmp.replace(folder / WEIGHTS)
    atomic_write_json(folder / META, dict(meta))
    return sha256_file(folder / WEIGHTS)


def finish_run(
    folder: Path,
    class_names: tuple[str, ...] | list[str],
    upstream: Mapping[str, str],
    code_version: str = "",
    info: Mapping[str, Any] | None = None,
) -> Manifest:
    """The manifest, last: the sha256 of the weights and of every other file now in the folder
    (subfolders such as checkpoints/ are the stage's working state, not its output; HOST holds
    the machine's facts, not the run's)."""
    folder = Path(folder)
    files = {
        p.name: sha256_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in (MANIFEST, HOST) and not p.name.startswith(".")
    }
    if WEIGHTS not in files or META not in files:
        raise RunError(f"{folder}: no {WEIGHTS} + {META} to finish the run with")
    manifest = Manifest(
        kind=RUN_KIND,
        class_names=tuple(class_names),
        shards=(),
        upstream=dict(upstream),
        code_version=code_version,
        info={**(info or {}), "weights_sha256": files[WEIGHTS], "files": files},
    )
    write_manifest(folder, manifest)
    return manifest


def save_weights(
    folder: Path,
    state_dict: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    upstream: Mapping[str, str] | None = None,
) -> Path:
    """A complete run in one call (weights, model.json, manifest): for runs made without a
    training stage (tools, tests). Stages write their metrics and plots in between."""
    write_weights(folder, state_dict, meta)
    finish_run(folder, meta.get("class_names", ()), upstream or {}, meta.get("code_version", ""))
    return Path(folder) / WEIGHTS


def run_complete(folder: Path, upstream: Mapping[str, str]) -> bool:
    """True if `folder` is a complete run made from these upstream manifests (a rerun only
    reads); False if it is not complete. A complete run made from other inputs is refused in
    one line: it is never rewritten."""
    folder = Path(folder)
    if not is_complete(folder):
        return False
    made_from = read_manifest(folder).upstream
    changed = sorted(
        k for k in made_from.keys() | upstream.keys() if made_from.get(k) != upstream.get(k)
    )
    if changed:
        raise RunError(
            f"{folder} is complete but was made from other inputs ({', '.join(changed)} changed "
            "since); remove the folder or choose another run name"
        )
    # the caller is the stage that writes the run: its own command makes it again
    check_files(folder, read_manifest(folder), f"remove {folder} and rerun the same command")
    return True


def check_files(folder: Path, manifest: Manifest, fix: str = "") -> None:
    """Every file the manifest pins (the weights, model.json, metrics, plots) is there with its
    sha256: a complete run whose weights were truncated or replaced is damaged, never "already
    finished". One line names the file and `fix` (default: the command that trains it again)."""
    fix = fix or damaged_fix(folder)
    pinned = dict(manifest.info.get("files", {}))
    pinned.setdefault(WEIGHTS, manifest.info.get("weights_sha256", ""))
    for name, digest in sorted(pinned.items(), key=lambda item: item[0] != WEIGHTS):
        path = Path(folder) / name
        if not path.is_file():
            raise RunError(f"{path} is missing from a complete run; {fix}")
        if sha256_file(path) != digest:
            raise RunError(
                f"{path}: sha256 differs from the run's manifest (damaged or replaced after the "
                f"run finished); {fix}"
            )


def damaged_fix(folder: Path) -> str:
    """How to make a damaged run again: remove its folder, then run its stage (the command, with
    the root and the run's name; the run's config.json holds every other setting it had)."""
    remake = remake_command(folder)
    how = f"`{remake[1]}`" if remake else "the command that made it"
    return f"remove {folder} and rebuild the run: {how}"


# ---------------------------------------------------------------- reading


def load_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file, or one line naming it when it is not one (e.g. a pickle renamed)."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as e:
        raise ShardError(
            f"{path} is not a readable safetensors file ({str(e).strip()[:80]}); "
            "it is damaged or of another format: rewrite it (rerun the stage that wrote it)"
        ) from e


@dataclass(frozen=True)
class Run:
    """A complete run folder: its manifest and model.json; weights loaded on demand."""

    folder: Path
    manifest: Manifest
    meta: dict[str, Any]

    @property
    def digest(self) -> str:
        """sha256 of manifest.json: what a stage that reads this run records as its upstream."""
        return manifest_digest(self.folder)

    def state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The weights, parsed and then checked against the manifest's sha256."""
        path = self.folder / WEIGHTS
        data = path.read_bytes()
        try:
            state = load(data)
        except (SafetensorError, OSError) as e:
            raise RunError(
                f"{path} is not a readable safetensors file ({str(e).strip()[:80]}); "
                f"it is damaged or of another format: {damaged_fix(self.folder)}"
            ) from e
        if sha256_bytes(data) != self.manifest.info.get("weights_sha256"):
            raise RunError(
                f"{path}: sha256 differs from the run's manifest (modified after the run "
                f"finished); {damaged_fix(self.folder)}"
            )
        bad = [k for k, v in state.items() if v.is_floating_point() and not v.isfinite().all()]
        if bad:  # a run that diverged before training stopped such runs: nothing can read it
            raise RunError(
                f"{path} holds non-finite weights ({bad[0]}{' and more' if bad[1:] else ''}): "
                f"the run diverged; {damaged_fix(self.folder)} (with a smaller lr if it was "
                "set)"
            )
        return {k: v.to(device) for k, v in state.items()}


def read_run(folder: Path, preset: str = "") -> Run:
    """The run in `folder`, or one line saying why it cannot be read (missing, incomplete,
    not a run), with the command that makes it (`preset`: the reader's own, for a root whose
    name is no preset and that records none)."""
    folder = Path(folder)
    remake = remake_command(folder, preset)
    if not (folder / META).is_file() or not (folder / WEIGHTS).is_file():
        root = folder.parent.parent  # <root>/train/<run>
        words = f"train with --set out={root.parent} name={root.name} run={folder.name}"
        how = f"`{remake[1]}`" if remake else words
        raise RunError(
            f"{folder} has no trained weights ({WEIGHTS} + {META}): check the run name, or "
            f"build the run first: {how}"
        )
    if not is_complete(folder):
        how = f": `{remake[1]}`" if remake else ""
        raise RunError(
            f"{folder} is incomplete: it has no {MANIFEST} (its stage did not finish); rerun "
            f"the stage to complete it{how}"
        )
    manifest = read_manifest(folder)
    if manifest.kind != RUN_KIND:
        raise RunError(f"{folder} holds a {manifest.kind!r} folder, not a trained run")
    meta = read_json(folder / META)
    missing = [k for k in ("arch", "class_names", "image_size", "normalize") if k not in meta]
    if missing:
        raise RunError(f"{folder / META} lacks {missing}; retrain the run with this version")
    return Run(folder, manifest, meta)


def load_weights(
    folder: Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, model.json) of a complete run, the weights' sha256 checked."""
    run = read_run(folder)
    return run.state_dict(device), run.meta


def load_model(
    folder: Path, build: Callable[[dict[str, Any]], nn.Module], device: str | torch.device = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """A trained run's network with its weights loaded, and its model.json.

    `build` turns `meta["arch"]` into the network (e.g. models.finetuning.build_model); it is
    passed in so that this on-disk module stays free of model code.
    """
    state, meta = load_weights(folder, device)
    model = build(meta["arch"])
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise RunError(f"{folder}: weights do not fit the architecture in {META} ({first})") from e
    return model.to(device), meta


def write_run(
    run_dir: Path,
    weights: dict[str, torch.Tensor],
    meta: dict[str, Any],
    metrics: dict[str, Any],
    plots: list[Callable[[Path], Any]],
    upstream: dict[str, str],
) -> None:
    """The run's outputs (main process): weights + model.json, metrics.json, the plots, and the
    manifest last, so a run folder with a manifest has every file."""
    write_weights(run_dir, weights, meta)
    atomic_write_json(run_dir / "metrics.json", metrics)
    for plot in plots:
        plot(run_dir)
    info = {k: meta[k] for k in ("run", "loss") if k in meta}
    finish_run(run_dir, meta["class_names"], upstream, code_version(), info)
