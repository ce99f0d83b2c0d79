"""`manifest.json`: the proof that a shard folder is complete.

A stage writes its manifest *last*, after every shard and completion record is on disk.
A folder without one is incomplete and no reader accepts it. The manifest records what a
downstream stage or a Hub user needs to trust the folder: class names, per-shard sample
counts and sha256, the digest of the upstream manifest(s) it was built from, and the code
version. It holds no timestamps and no absolute paths, so reruns give the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import PRESET_NAMES
from core.io import atomic_write_json, read_json, sha256_bytes, sha256_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class ShardError(ValueError):
    """A shard folder is missing, incomplete, corrupt or inconsistent (the base of every error
    about what semix keeps on disk: `except ShardError` catches the narrower ones too)."""


def is_complete(folder: Path) -> bool:
    """Whether `folder` is a complete output: its manifest exists. Every stage writes the
    manifest last (and nothing in the folder changes after it), so this is the one completion
    rule of every output folder (docs/architecture.md); whether the folder is also the right
    one (its config, its upstream digests, its files' sha256) is each reader's own check."""
    return (Path(folder) / MANIFEST).is_file()


# Which stage writes which folder of a runs root, filled by the stage registry
# (pipeline/registry.py `register_stage`, the built-in stages and a plugin's alike): this layer
# sits below the stages and cannot import them, so registration brings the facts down here.
# manifest kind -> the stage(s) that write such a folder: what a user reruns when one is damaged
WRITTEN_BY: dict[str, str] = {}
# a folder of a runs root (runs/<name>/...), by its name or its parent's -> the stage writing it
FOLDER_STAGES: dict[str, str] = {}
PARENT_STAGES: dict[str, str] = {}
# the stage a hint names -> the other stages that write the same folder (annotate: pull)
ALSO_WRITTEN_BY: dict[str, list[str]] = {}
_KIND_WRITERS: dict[str, list[str]] = {}


def _either(stages: list[str]) -> str:
    """The words `annotate (or pull)`: the first stage, then the others writing the same."""
    return stages[0] + (f" (or {' or '.join(stages[1:])})" if len(stages) > 1 else "")


def register_outputs(stage: str, *, folder: str = "", parent: str = "", kind: str = "") -> None:
    """Say what `stage` writes, so a missing or damaged output names the command that rewrites
    it: `folder` (runs/<name>/<folder>) or `parent` (runs/<name>/<parent>/<one of many>), and
    its manifest `kind`. A folder another stage registered first stays that stage's (the hints
    name it, then this one: `rerun annotate (or pull)`)."""
    for owners, key in ((FOLDER_STAGES, folder), (PARENT_STAGES, parent)):
        if key and owners.setdefault(key, stage) != stage:
            ALSO_WRITTEN_BY.setdefault(owners[key], []).append(stage)
    if kind:
        _KIND_WRITERS.setdefault(kind, []).append(stage)
        WRITTEN_BY[kind] = _either(_KIND_WRITERS[kind])


def _config_of(folder: Path) -> dict[str, Any]:
    """A folder's config.json (written first by every stage), {} when absent or unreadable."""
    try:
        data = read_json(Path(folder) / "config.json")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _run_sets(stage: str, folder: Path) -> dict[str, Any]:
    """What names a train or finetune run on the command line, from its config.json when it has
    one; what only the user knows is a <placeholder>."""
    recorded = _config_of(folder)
    if stage == "train":  # the run name defaults to the loss
        if "loss" not in recorded:  # never trained: the run's name, the preset's loss
            return {"run": folder.name}
        loss = recorded["loss"]
        return {"loss": loss} if folder.name == loss else {"run": folder.name, "loss": loss}
    if stage == "finetune":  # the folder is <run>-<objective>; config.json records it as `method`
        objective = recorded.get("method", "<objective>")
        return {"run": recorded.get("run", "<run>"), "objective": objective}
    return {}


def _arg(text: str) -> str:
    return text if re.fullmatch(r"[\w./:=,<>@+-]+", text) else shlex.quote(text)


def remake_command(folder: Path, preset: str = "") -> tuple[str, str] | None:
    """(stage, command line) that writes `folder`, for a folder where the stages put it in a runs
    root (runs/<name>/real/train, .../series, .../train/<run>, ...); None for any other folder.
    `--preset` is the root's name when that is a preset, else what prepare recorded in
    real/config.json, else `preset` (the caller's own, when it has one); `out=` and `name=` are
    set when they are not the defaults. None too when the command would need a value nothing
    records (an unprepared root under another name): every command a hint prints runs as
    printed."""
    folder = Path(folder)
    if folder.name in FOLDER_STAGES:
        stage, root = FOLDER_STAGES[folder.name], folder.parent
    elif folder.parent.name in PARENT_STAGES:
        stage, root = PARENT_STAGES[folder.parent.name], folder.parent.parent
    else:
        return None
    if root.name in ("", ".", ".."):
        return None
    chosen, recorded = root.name, _config_of(root / "real")
    if chosen not in PRESET_NAMES:
        chosen = recorded.get("classes_file") or recorded.get("preset") or preset or "<preset>"
        recipe = _recipe(recorded.get("preset", ""))
        if recorded.get("classes_file") and recipe:  # a classes file's recipe: kept
            chosen += RECIPE_MARK + recipe
    own = {"source": "<edm.pkl>"} if stage == "convert-edm" else _run_sets(stage, folder)
    if stage == "prepare":  # where the data were read from: the preset does not say
        own |= {k: recorded[k] for k in ("data_dir", "hf_dataset") if recorded.get(k)}
    command = stage_command(stage, root, chosen, own)
    if "<" in command:  # a value only the user knows: words, never a command that fails
        return None
    return stage, command


# DATA+RECIPE: how a --preset with --recipe is recorded (stages/presets' RECIPE_MARK)
RECIPE_MARK = "+"


def _recipe(preset: str) -> str:
    """The recipe a recorded preset names (`imagefolder+digits`: digits), "" for none: a hint
    spells it `--recipe`, as the user did."""
    _, mark, recipe = preset.rpartition(RECIPE_MARK)
    return recipe if mark and recipe in PRESET_NAMES else ""


def stage_command(stage: str, root: Path, preset: str, sets: dict[str, Any] | None = None) -> str:
    """`python -m pipeline <stage> --preset <preset> --set ...` for the runs root `root`: `out=`
    and `name=` when they are not the defaults, then `sets`, quoted for a shell."""
    root = Path(root)
    words = [] if root.parent == Path("runs") else [f"out={root.parent}"]
    recipe = _recipe(preset)
    data = preset.removesuffix(RECIPE_MARK + recipe) if recipe else preset
    named = Path(data).stem if data.endswith(".txt") else data
    if root.name != named + (RECIPE_MARK + recipe if recipe else ""):
        words.append(f"name={root.name}")
    words += [f"{k}={v}" for k, v in (sets or {}).items()]
    argv = [
        "python",
        "-m",
        "pipeline",
        stage,
        "--preset",
        data,
        *(["--recipe", recipe] * bool(recipe)),
    ]
    return " ".join(map(_arg, [*argv, *(["--set", *words] if words else [])]))


def rerun_hint(kind: str, folder: Path | None = None) -> str:
    """What to do about a damaged folder: remove it and rerun its stage, with the command line
    when the folder lies in a runs root (`remake_command`)."""
    remake = remake_command(folder) if folder is not None else None
    if remake is None:
        return f"remove the folder and rerun {WRITTEN_BY.get(kind, 'the stage that wrote it')}"
    stage, command = remake
    writers = _either([stage, *ALSO_WRITTEN_BY.get(stage, [])])
    return f"remove the folder and rerun {writers}: `{command}`"


@dataclass(frozen=True)
class ShardRecord:
    """One complete shard: file name (relative to its folder), samples, checksum, size."""

    name: str
    count: int
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    kind: str  # "real" | "series" | "mixed"
    class_names: tuple[str, ...]
    shards: tuple[ShardRecord, ...]
    upstream: dict[str, str] = field(default_factory=dict)  # role -> manifest digest
    code_version: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # stage-specific facts (image size, ...)
    schema_version: int = SCHEMA_VERSION

    @property
    def num_samples(self) -> int:
        return sum(s.count for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["class_names"] = list(self.class_names)
        d["shards"] = [dataclasses.asdict(s) for s in self.shards]
        d["num_samples"] = self.num_samples
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], folder: Path | None = None) -> Manifest:
        """The manifest `d` (read from `folder`, named in the hints), checked."""
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ShardError(
                f"manifest schema version {version!r} is not supported (expected {SCHEMA_VERSION})"
            )
        shards = tuple(_shard_record(s) for s in d["shards"])
        total = sum(s.count for s in shards)
        # num_samples is derived, but readers (and Hub users) take it at its word: it must agree
        if "num_samples" in d and d["num_samples"] != total:
            raise ShardError(
                f"num_samples is {d['num_samples']!r} but its shards hold {total} samples "
                f"(edited or damaged); {rerun_hint(d.get('kind', ''), folder)}"
            )
        return cls(
            kind=d["kind"],
            class_names=tuple(d["class_names"]),
            shards=shards,
            upstream=dict(d.get("upstream", {})),
            code_version=d.get("code_version", ""),
            info=dict(d.get("info", {})),
            schema_version=version,
        )


def _shard_record(d: dict[str, Any]) -> ShardRecord:
    """A manifest's shard entry, type-checked: a name that is a plain file in the folder (never a
    path that could point elsewhere), a non-negative count and size, a sha256 hex digest."""
    rec = ShardRecord(**d)
    plain = (
        isinstance(rec.name, str)
        and rec.name == Path(rec.name).name
        and rec.name not in ("", ".", "..")
    )
    counts = all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (rec.count, rec.bytes)
    )
    digest = (
        isinstance(rec.sha256, str)
        and len(rec.sha256) == 64
        and all(c in "0123456789abcdef" for c in rec.sha256)
    )
    if not (plain and counts and digest):
        raise ShardError(f"malformed shard entry {d!r}")
    return rec


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = Path(folder) / MANIFEST
    atomic_write_json(path, manifest.to_dict())
    return path


def _make_hint(folder: Path) -> str:
    """What makes a missing folder: the command when everything it needs is recorded, else the
    stage in words (what only the user knows is never a <placeholder> that fails as printed)."""
    remake = remake_command(folder)
    if remake:
        return f"run {remake[0]} first: `{remake[1]}`"
    stage = FOLDER_STAGES.get(folder.name) or PARENT_STAGES.get(folder.parent.name)
    if stage == "prepare":
        root = folder.parent.parent
        return f"run prepare first, with the preset this root is for and --set out={root.parent} name={root.name}"
    return f"run {stage} first" if stage else "run the stage that writes it"


def read_manifest(folder: Path) -> Manifest:
    """A complete folder's manifest, or one line saying what is wrong and what to do: the
    command that makes a missing or incomplete folder, or restoring / rebuilding a bad file."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ShardError(f"{folder} does not exist: {_make_hint(folder)}")
    if not is_complete(folder):
        remake = remake_command(folder)
        how = f"rerun {remake[0]} to complete it: `{remake[1]}`" if remake else "rerun it"
        raise ShardError(
            f"{folder} is incomplete: it has no {MANIFEST} (the stage that writes it did not "
            f"finish); {how}"
        )
    try:
        data = read_json(path)
        if not isinstance(data, dict):
            raise ShardError(f"it holds a JSON {type(data).__name__}, not an object")
        return Manifest.from_dict(data, folder)
    except json.JSONDecodeError as e:
        problem = f"is not JSON ({e})"
    except KeyError as e:
        problem = f"is not a valid semix manifest: it lacks the key {e}"
    except ShardError as e:
        if "rerun" in str(e):  # says what to do already
            raise ShardError(f"{path} is not a valid semix manifest: {e}") from e
        problem = f"is not a valid semix manifest: {e}"
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type, bad UTF-8
        problem = f"is not a valid semix manifest: {e}"
    raise ShardError(f"{path} {problem}; restore the file, or {rerun_hint('', folder)}")


def manifest_digest(folder: Path) -> str:
    """sha256 of the manifest bytes: how downstream stages pin the exact upstream folder."""
    if not is_complete(folder):
        read_manifest(folder)  # raises the helpful "incomplete" error
    return sha256_bytes((Path(folder) / MANIFEST).read_bytes())


def verify_shards(folder: Path, manifest: Manifest | None = None) -> Manifest:
    """Check every shard's size and sha256 against the manifest; raise naming the first bad one."""
    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    for rec in manifest.shards:
        check_shard(folder / rec.name, rec, manifest.kind)
    return manifest


def check_shard(path: Path, rec: ShardRecord, kind: str = "") -> None:
    """One shard on disk against its record: present, same size, same sha256."""
    if not path.is_file():
        raise ShardError(
            f"{path} is listed in the manifest but missing; {rerun_hint(kind, path.parent)}"
        )
    check_size(path, path.stat().st_size, rec, kind)
    check_digest(path, sha256_file(path), rec, kind)


def check_size(path: Path, size: int, rec: ShardRecord, kind: str = "") -> None:
    if size != rec.bytes:
        raise ShardError(
            f"{path}: size {size} != {rec.bytes} in the manifest (truncated or replaced); "
            f"{rerun_hint(kind, path.parent)}"
        )


def check_digest(path: Path, digest: str, rec: ShardRecord, kind: str = "") -> None:
    if digest != rec.sha256:
        raise ShardError(
            f"{path}: sha256 mismatch ({digest[:12]}… != {rec.sha256[:12]}… in the manifest): "
            f"the shard is corrupt; {rerun_hint(kind, path.parent)}"
        )
