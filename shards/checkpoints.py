"""Training checkpoints on disk: one protocol for train, finetune and fit-generator.

A run's `checkpoints/checkpoint_<n>/` folder is complete when it exists under that name: a save
never writes there directly.

Save (`Checkpointer.save`):
  1. every process writes into `checkpoints/.tmp-checkpoint_<n>/` (accelerate's `save_state`:
     model, optimizer, one RNG file per rank);
  2. the main process adds semix's own state (safetensors files), flushes every file to disk and
     writes the marker `semix_state.json` (JSON) last;
  3. the folder is renamed to `checkpoint_<n>` (one atomic rename);
  4. only then are checkpoints beyond `keep` removed, oldest first, each renamed to
     `.old-checkpoint_<m>` before its files go, so a kill while pruning never leaves a partial
     folder under a checkpoint name.
A kill or a full disk at any point leaves the previous checkpoints as they were. Load takes the
newest complete checkpoint; `tidy` removes temporary, half-removed and incomplete folders.

What is loaded is checked first (`check_checkpoint`). accelerate's own files: the model
(safetensors), optimizer and scheduler (`.bin`) and RNG states (`random_states_<rank>.pkl`), read
by accelerate >= 1.x with `torch.load(weights_only=True)` (tensors and plain containers, no
code runs; `LOAD_KWARGS`). Objects registered with `register_for_checkpointing` would be
unpickled in full, so semix registers none: its state is safetensors + JSON, and a folder that
holds a `custom_checkpoint_*.pkl` or any other unknown file is refused rather than loaded.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from core.io import canonical_json, read_json
from shards.manifest import ShardError
from shards.runs import load_safetensors

MARKER = "semix_state.json"  # written last: the checkpoint's own completion record
PREFIX = "checkpoint_"
TMP, OLD = ".tmp-", ".old-"  # a save in progress; a checkpoint being removed

# accelerate's own files, all read with weights_only=True (or safetensors)
_ACCELERATE = (
    r"model(_\d+)?\.safetensors",
    r"(optimizer|scheduler|sampler)(_\d+)?\.bin",
    r"random_states_\d+\.pkl",
    r"scaler\.pt",
)
LOAD_KWARGS = {"weights_only": True}  # for accelerator.load_state(load_kwargs=...)
RESUME_HELP = "auto (newest if any), latest (newest, must exist), '' (start over) or a folder"


def check_checkpoint(folder: Path, marker: str = MARKER, ours: tuple[str, ...] = ()) -> Path:
    """`folder` is a complete checkpoint (`marker`, written last, exists) holding only files that
    load without unpickling: accelerate's own, and `ours` (semix's safetensors / JSON files)."""
    folder = Path(folder)
    if not (folder / marker).is_file():
        raise ShardError(f"{folder} is not a complete semix checkpoint (no {marker}); use another")
    allowed = re.compile("|".join([*_ACCELERATE, *map(re.escape, (marker, *ours))]))
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not allowed.fullmatch(path.name):
            raise ShardError(
                f"{path}: not a file semix checkpoints hold (pickled state is never loaded); "
                f"remove it, or start over without this checkpoint"
            )
    return folder


def checkpoint_number(path: Path) -> int | None:
    """n of a `checkpoint_<n>` folder name, else None."""
    n = Path(path).name.removeprefix(PREFIX)
    return int(n) if Path(path).name.startswith(PREFIX) and n.isdigit() else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Rename out of the way first (atomic), then delete: a kill midway leaves an .old- folder."""
    if path.name.startswith(PREFIX):
        trash = path.with_name(OLD + path.name)
        shutil.rmtree(trash, ignore_errors=True)
        path = path.rename(trash)
    shutil.rmtree(path)


class Checkpointer:
    """`checkpoints/` of one run. Every process makes the same calls; only the main one renames
    or removes, and `barrier` (accelerator.wait_for_everyone) keeps the others in step.

    `files`: semix's own safetensors files a checkpoint may hold besides the marker.
    `share(value)`: every process gets the main process's `value` (a broadcast). With it, which
    checkpoint to resume from is decided once, on the main process: on a shared filesystem
    (NFS) another node's cached listing may not show the newest checkpoint yet, and ranks that
    resumed from different epochs would train on as one run. Without it (one process), every
    process decides for itself.
    """

    def __init__(
        self,
        folder: Path,
        *,
        keep: int,
        files: tuple[str, ...] = (),
        is_main: bool = True,
        barrier: Callable[[], None] = lambda: None,
        share: Callable[[Any], Any] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep at least one checkpoint, got keep={keep}")
        self.folder, self.keep, self.files = Path(folder), keep, files
        self.is_main, self.barrier, self.share = is_main, barrier, share

    # ------------------------------------------------------------ reading

    def complete(self) -> dict[int, Path]:
        """{n: folder} of the complete checkpoints (named checkpoint_<n>, marker inside)."""
        found = {}
        for path in self.folder.glob(PREFIX + "*") if self.folder.is_dir() else ():
            n = checkpoint_number(path)
            if n is not None and (path / MARKER).is_file():
                found[n] = path
        return found

    def choose(self, resume: str) -> Path | None:
        """The checkpoint `resume` asks for (RESUME_HELP); None = start from scratch. With
        `share`, the main process's answer (or its one-line error) on every process."""
        if self.share is None:
            return self._choose(resume)
        answer: tuple[str, str | None] | None = None
        if self.is_main:
            try:
                chosen = self._choose(resume)
                answer = ("path", None if chosen is None else str(chosen))
            except ShardError as e:  # every process fails with it (none waits forever)
                answer = ("error", str(e))
        kind, value = self.share(answer)
        if kind == "error":
            raise ShardError(value)
        return None if value is None else Path(value)

    def _choose(self, resume: str) -> Path | None:
        if resume == "":
            return None
        complete = self.complete()
        if resume in ("auto", "latest"):
            if not complete and resume == "latest":
                raise ShardError(f"resume=latest: {self.folder} holds no complete checkpoint")
            return complete[max(complete)] if complete else None
        path = Path(resume)
        if not path.is_dir() or checkpoint_number(path) is None:
            raise ShardError(f"resume={resume}: not a checkpoint_<n> folder (or {RESUME_HELP})")
        return check_checkpoint(path, MARKER, self.files)

    def load(
        self, path: Path, read: Callable[[Path], None], device: str | torch.device = "cpu"
    ) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """Check `path`, let `read` load accelerate's state from it, return (the marker's JSON
        state, {file: tensors} of semix's own files that are present)."""
        check_checkpoint(path, MARKER, self.files)
        read(path)
        tensors = {
            name: load_safetensors(path / name, device)
            for name in self.files
            if (path / name).is_file()
        }
        return read_json(path / MARKER), tensors

    # ------------------------------------------------------------ writing

    def tidy(self, first_free: int) -> None:
        """Before training: remove temporary, half-removed and incomplete folders, and every
        checkpoint numbered `first_free` or above (a future the run is about to replay, or all
        of them when it starts over)."""
        if self.is_main and self.folder.is_dir():
            complete = self.complete()
            for path in sorted(self.folder.iterdir()):
                n = checkpoint_number(path)
                if path.name.startswith((TMP, OLD)):
                    shutil.rmtree(path)
                elif n is not None and (n not in complete or n >= first_free):
                    _remove(path)
        self.barrier()

    def save(
        self,
        number: int,
        write: Callable[[Path], Any],
        state: Mapping[str, Any],
        tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> Path:
        """checkpoint_<number>: `write(folder)` on every process (accelerate's save_state), then
        the `tensors` files and `state` (the marker) on the main one, rename, prune. Returns the
        folder."""
        final = self.folder / f"{PREFIX}{number}"
        tmp = self.folder / f"{TMP}{final.name}"
        unknown = set(tensors or {}) - set(self.files)
        if unknown:
            raise ValueError(f"checkpoint files {sorted(unknown)} are not declared in `files`")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # what a killed save of this number left
            tmp.mkdir(parents=True)
        self.barrier()
        write(tmp)
        self.barrier()
        if self.is_main:
            for name, values in (tensors or {}).items():
                values = {k: v.detach().cpu().contiguous() for k, v in values.items()}
                save_file(values, str(tmp / name))
            for path in tmp.iterdir():  # on disk before the marker says they are
                _fsync(path)
            with open(tmp / MARKER, "wb") as f:
                f.write(canonical_json(dict(state)))
                f.flush()
                os.fsync(f.fileno())
            _fsync(tmp)
            if final.exists():
                _remove(final)
            tmp.rename(final)
            _fsync(self.folder)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        complete = self.complete()
        for n in sorted(complete)[: max(0, len(complete) - self.keep)]:
            _remove(complete[n])
