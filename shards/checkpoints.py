"""Training checkpoints on disk: one protocol for train, finetune and fit-generator.

A run's `checkpoints/checkpoint_<n>/` folder is complete when it exists under that name: a save
never writes there directly.

Save (`Checkpointer.save`):
  1. every process writes into `checkpoints/.tmp-checkpoint_<n>/` (accelerate's `save_state`:
     model, optimizer, one RNG file per rank);
  2. the main process adds semix's own state (safetensors files), flushes every file to disk,
     hashes it, and writes the marker `semix_state.json` (JSON) last: the caller's state plus
     `"files": {name: {"bytes", "sha256"}}`, the record of every other file of the checkpoint;
  3. the folder is renamed to `checkpoint_<n>` (one atomic rename);
  4. only then are checkpoints beyond `keep` removed, oldest first, each renamed to
     `.old-checkpoint_<m>` before its files go, so a kill while pruning never leaves a partial
     folder under a checkpoint name.
A kill or a full disk at any point leaves the previous checkpoints as they were (a failed
write is an OSError naming the checkpoint, `core.io.writing`). Load takes the newest complete
checkpoint; `tidy` removes temporary, half-removed and incomplete folders.

What is loaded is checked first, as a whole (`verify_checkpoint`), before any file is read:
only known file names (`check_checkpoint`), and every file, the RNG states of every rank
included, has its recorded size and sha256, with no file missing or added. accelerate would
not notice a damaged RNG file (it logs "Could not load random states" and goes on with the
current ones), and a bit flip in a float tensor loads silently. A damaged newest checkpoint is
logged in one line naming the file and the previous complete one is taken (one more line);
with none left, resume stops in one line (`checkpoint.resume=` starts over). A checkpoint written
before the record existed (a marker without "files") is loaded unverified, with a warning.

accelerate's own files: the model (safetensors), optimizer and scheduler (`.bin`) and RNG
states (`random_states_<rank>.pkl`), read by accelerate >= 1.x with `torch.load(weights_only=True)`
(tensors and plain containers, no code runs; `LOAD_KWARGS`). Objects registered with
`register_for_checkpointing` would be unpickled in full, so semix registers none: its state is
safetensors + JSON, and a folder that holds a `custom_checkpoint_*.pkl` or any other unknown
file is refused rather than loaded. A file that still does not load (a foreign pickle under a
known name, a truncated file in an unverified checkpoint) stops in one line (`Checkpointer.load`).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from core.io import canonical_json, read_json, sha256_file, writing
from core.launch import is_peer_failure
from core.logs import log
from shards.manifest import ShardError
from shards.runs import load_safetensors

MARKER = "semix_state.json"  # written last: the checkpoint's own completion record


class CheckpointError(ShardError):
    """A checkpoint is missing, incomplete, damaged or does not load: named for what failed (the
    fix is the checkpoint's), a ShardError for every `except ShardError` and the CLI's exit 1."""


FILES = "files"  # in the marker: {name: {"bytes", "sha256"}} of every other file
_HEX = re.compile(r"[0-9a-f]{64}")
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
# what to paste: the field's current path (`--set checkpoint.resume=`; make's SET passes it)
START_OVER = (
    "start over with --set checkpoint.resume= (make: SET=checkpoint.resume=) or remove the folder"
)
# what a file that is no loadable state raises while `read` loads it (torch.load with
# weights_only, safetensors, load_state_dict): turned into one line, never a traceback
_LOAD_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, KeyError)


def check_checkpoint(folder: Path, marker: str = MARKER, ours: tuple[str, ...] = ()) -> Path:
    """`folder` is a complete checkpoint (`marker`, written last, exists) holding only files that
    load without unpickling: accelerate's own, and `ours` (semix's safetensors / JSON files)."""
    folder = Path(folder)
    if not (folder / marker).is_file():
        raise CheckpointError(
            f"{folder} is not a complete semix checkpoint (no {marker}); use another"
        )
    allowed = re.compile("|".join([*_ACCELERATE, *map(re.escape, (marker, *ours))]))
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not allowed.fullmatch(path.name):
            raise CheckpointError(
                f"{path}: not a file semix checkpoints hold (pickled state is never loaded); "
                f"remove it, or start over without this checkpoint"
            )
    return folder


def verify_checkpoint(
    folder: Path, ours: tuple[str, ...] = (), *, hashes: bool = True
) -> tuple[dict[str, Any], bool]:
    """(the state the marker holds, whether it carries a file record) of a complete checkpoint
    whose files are all its record's: each listed file present with its size and (`hashes`)
    its sha256, none unlisted, names as `check_checkpoint` allows. Raises CheckpointError naming
    the first file that is not. A marker without a record passes: (state,
    False), its files unverified (docs/compat.md)."""
    folder = check_checkpoint(folder, MARKER, ours)
    marker = folder / MARKER
    try:
        saved = read_json(marker)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"{marker}: unreadable ({str(e)[:80]}); the checkpoint is damaged"
        ) from e
    if not isinstance(saved, dict):
        raise CheckpointError(f"{marker}: not a JSON object; the checkpoint is damaged")
    record = saved.pop(FILES, None)
    if record is None:
        return saved, False
    if not isinstance(record, dict) or not all(
        isinstance(name, str)
        and name == Path(name).name
        and name not in ("", ".", "..", MARKER)
        and isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and _HEX.fullmatch(str(entry.get("sha256", "")))
        for name, entry in record.items()
    ):
        raise CheckpointError(f"{marker}: malformed file record; the checkpoint is damaged")
    present = {p.name for p in folder.iterdir()} - {MARKER}
    unlisted = sorted(present - set(record))
    if unlisted:
        raise CheckpointError(
            f"{folder / unlisted[0]}: not in the checkpoint's record (added after it was written)"
        )
    for name, entry in sorted(record.items()):
        path = folder / name
        if name not in present:
            raise CheckpointError(f"{path}: missing (the checkpoint's record lists it)")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the checkpoint's record says {entry['bytes']} "
                "(truncated or damaged)"
            )
        if hashes and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the checkpoint's record (damaged)")
    return saved, True


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


def _seal(path: Path) -> dict[str, Any]:
    """Flush `path` to disk and return its record entry (read once: hashed while it is read)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": h.hexdigest()}


def _why(error: BaseException) -> str:
    """A load error in a few words (torch's messages run to paragraphs, some with advice to
    unpickle in full)."""
    if isinstance(error, pickle.UnpicklingError):
        return "a pickle that is not plain tensors, or damaged: refused, nothing in it ran"
    first = (str(error).strip().splitlines() or [""])[0]
    first = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", first).split(". ")[0]
    return f"{type(error).__name__}: {first[:100]}" if first else type(error).__name__


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
    `ranks`: the number of processes; the record names each one's `random_states_<r>.pkl`
    explicitly (opened by name, which a shared filesystem revalidates, where a listing made on
    the main node may still miss files another node just wrote).
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
        ranks: int = 1,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep at least one checkpoint, got keep={keep}")
        self.folder, self.keep, self.files = Path(folder), keep, files
        self.is_main, self.barrier, self.share, self.ranks = is_main, barrier, share, ranks
        self._verified: dict[Path, dict[str, Any]] = {}  # chosen here, hashed once: its state

    # ------------------------------------------------------------ reading

    def complete(self) -> dict[int, Path]:
        """{n: folder} of the complete checkpoints (named checkpoint_<n>, marker inside)."""
        found = {}
        for path in self.folder.glob(PREFIX + "*") if self.folder.is_dir() else ():
            n = checkpoint_number(path)
            if n is not None and (path / MARKER).is_file():
                found[n] = path
        return found

    def choose(self, resume: str, verify: bool = True) -> Path | None:
        """The checkpoint `resume` asks for (RESUME_HELP); None = start from scratch. With
        `verify` (the default) it is checked as a whole (`verify_checkpoint`), and auto/latest
        pass over damaged ones to the newest intact one; without, only the form of `resume`
        and the completion marker are (a cheap check before any work). With `share`, the main
        process's answer (or its one-line error) on every process."""
        if self.share is None:
            return self._choose(resume, verify)
        answer: tuple[str, str | None] | None = None
        if self.is_main:
            try:
                chosen = self._choose(resume, verify)
                answer = ("path", None if chosen is None else str(chosen))
            except ShardError as e:  # every process fails with it (none waits forever)
                answer = ("error", str(e))
        kind, value = self.share(answer)
        if kind == "error":
            raise CheckpointError(value)
        return None if value is None else Path(value)

    def _choose(self, resume: str, verify: bool) -> Path | None:
        if resume == "":
            return None
        complete = self.complete()
        if resume in ("auto", "latest"):
            if not complete and resume == "latest":
                raise CheckpointError(
                    f"checkpoint.resume=latest: {self.folder} holds no complete checkpoint"
                )
            if not complete:
                return None
            return self._newest_intact(complete) if verify else complete[max(complete)]
        path = Path(resume)
        if not path.is_dir() or checkpoint_number(path) is None:
            raise CheckpointError(
                f"checkpoint.resume={resume}: not a checkpoint_<n> folder (or {RESUME_HELP})"
            )
        if not verify:
            if not (path / MARKER).is_file():
                raise CheckpointError(f"{path} is not a complete semix checkpoint (no {MARKER})")
            return path
        self._accept(path)
        return path

    def _newest_intact(self, complete: dict[int, Path]) -> Path:
        """The newest checkpoint that verifies; each damaged one newer than it is one log line
        naming the file, and taking an older one is one more. None intact: one-line error."""
        damage = None
        for n in sorted(complete, reverse=True):
            try:
                self._accept(complete[n])
            except CheckpointError as e:
                log.warning("damaged checkpoint, not resumed from: %s", e)
                damage = damage or e
                continue
            if damage is not None:
                log.warning(
                    "resuming from the previous complete checkpoint %s instead (the work after "
                    "it is redone)",
                    complete[n],
                )
            return complete[n]
        raise CheckpointError(f"{damage}; {self.folder} holds no intact checkpoint: {START_OVER}")

    def _accept(self, path: Path) -> None:
        """Verify `path` as a whole (raises CheckpointError) and keep its state for `load`."""
        state, recorded = verify_checkpoint(path, self.files)
        if not recorded:
            log.warning(
                "%s has no sha256 record: its files are loaded unverified",
                path,
            )
        self._verified[Path(path)] = state

    def load(
        self, path: Path, read: Callable[[Path], None], device: str | torch.device = "cpu"
    ) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """Verify `path` (unless `choose` just did, here), let `read` load accelerate's state
        from it, return (the marker's JSON state without the record, {file: tensors} of semix's
        own files that are present). A file that does not load is one line, never a traceback.
        A process other than the main one under `share` checks names and sizes only: the main
        process hashed every file, every rank's RNG states included, when it chose."""
        path = Path(path)
        state = self._verified.pop(path, None)
        if state is None:
            hashes = self.share is None or self.is_main
            state, _ = verify_checkpoint(path, self.files, hashes=hashes)
        try:
            read(path)
        except (ShardError, torch.OutOfMemoryError):
            raise
        except (*_LOAD_ERRORS, SafetensorError) as e:
            if is_peer_failure(e):  # another rank left: not this checkpoint's fault
                raise
            raise CheckpointError(
                f"{path}: this checkpoint does not load ({_why(e)}); {START_OVER}"
            ) from e
        present = [name for name in self.files if (path / name).is_file()]
        try:
            tensors = {name: load_safetensors(path / name, device) for name in present}
        except ShardError as e:  # a file that is no safetensors: the checkpoint is what failed
            raise CheckpointError(str(e)) from e
        return state, tensors

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
        if FILES in state:
            raise ValueError(f"{FILES!r} is the checkpoint's file record, not a state key")
        # a full disk or read-only media names the checkpoint (torch.save and safetensors
        # report their I/O errors without a file name or errno); the previous ones stay
        with writing(final, tmp):
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
                # every file on disk and recorded (every rank's) before the marker says so
                names = {p.name for p in tmp.iterdir()} | self._rng_files(tmp)
                record = {name: _seal(tmp / name) for name in sorted(names)}
                with open(tmp / MARKER, "wb") as f:
                    f.write(canonical_json({**state, FILES: record}))
                    f.flush()
                    os.fsync(f.fileno())
                _fsync(tmp)
                if final.exists():
                    _remove(final)
                tmp.rename(final)
                _fsync(self.folder)
        if self.is_main:
            self._prune()
        self.barrier()
        return final

    def _rng_files(self, tmp: Path) -> set[str]:
        """Each rank's RNG file, when the save wrote the main one's (accelerate's save_state)."""
        if self.ranks == 1 or not (tmp / "random_states_0.pkl").is_file():
            return set()
        return {f"random_states_{r}.pkl" for r in range(self.ranks)}

    def _prune(self) -> None:
        complete = self.complete()
        for n in sorted(complete)[: max(0, len(complete) - self.keep)]:
            _remove(complete[n])
