"""The Hugging Face Hub side of a mixed/ folder: dataset card, upload plan, publish, pull.

    publish: verified folder -> card bytes (README.md) -> plan -> create_repo + ONE create_commit
    pull:    snapshot_download into a hidden sibling -> verify every shard -> rename into place

The card is built in memory and uploaded from bytes: mixed/ is a finished folder (its manifest
exists) and publishing never writes into it. The repo holds the card, so `pull` installs it as
mixed/README.md next to the verified shards.

Why one commit: a Hub commit is atomic, so a repo either holds the whole dataset, manifest
included, or nothing new; a failed upload never leaves a half-published dataset that looks
complete. It is still resumable: huggingface_hub uploads large files by content hash and skips
blobs the Hub already has, so a retry sends only what is missing, and an unchanged rerun makes
no commit at all. The client is always the real `HfApi`; the token is whatever it finds
(HF_TOKEN or the saved login). We never pass it around, and every message we raise is scrubbed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
)
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors import safe_open

from shards.card import DATA_GLOB
from shards.manifest import (
    MANIFEST,
    Manifest,
    ShardError,
    is_complete,
    read_manifest,
    verify_shards,
)

CARD = "README.md"
# Optional files uploaded when present. Never uploaded: config.json (it holds local paths: the
# card states the settings from the manifest instead) and .done/ (local resume bookkeeping).
EXTRAS = ("annotation.json", "annotation.png", "preview.png", "prototypes.safetensors")
EXTRAS += ("prototypes.json", "ternary.png")  # ternary.png: k = 3 mixed data only
PULL_PATTERNS = (DATA_GLOB, MANIFEST, CARD, *EXTRAS)
REMOTE_KEEP = (".gitattributes",)  # created by the Hub with the repo; not ours to delete

_ABSOLUTE = re.compile(r"^(/|~|[A-Za-z]:[\\/]|file:)")
_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{6,}")


class HubError(ValueError):
    """Publishing or pulling failed for a reason the user must fix; the CLI prints one line."""


# ------------------------------------------------------------------------- upload plan


@dataclass(frozen=True)
class PlannedFile:
    """One file of the upload: from disk (`local`) or from memory (`data`, the card)."""

    local: Path | None
    repo_path: str
    bytes: int
    data: bytes | None = None

    def read_bytes(self) -> bytes:
        return self.data if self.data is not None else Path(self.local).read_bytes()


def upload_plan(folder: Path, manifest: Manifest, card: bytes) -> list[PlannedFile]:
    """Shards in manifest order, manifest.json, the card (from memory), then the extras that
    exist. A README.md lying in the folder is not uploaded (the card is)."""
    names = [rec.name for rec in manifest.shards] + [MANIFEST]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise HubError(f"{folder} lacks {', '.join(missing)}: nothing to publish without it")
    plan = [PlannedFile(folder / n, n, (folder / n).stat().st_size) for n in names]
    plan.append(PlannedFile(None, CARD, len(card), data=card))
    extras = [name for name in EXTRAS if (folder / name).is_file()]
    return plan + [PlannedFile(folder / n, n, (folder / n).stat().st_size) for n in extras]


def find_local_paths(obj: Any, where: str, markers: Sequence[str]) -> Iterator[str]:
    """'where.key = value' for every string that is an absolute path or names this machine."""
    if isinstance(obj, str):
        if _ABSOLUTE.match(obj) or any(m in obj for m in markers):
            yield f"{where} = {obj!r}"
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from find_local_paths(value, f"{where}.{key}", markers)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from find_local_paths(value, f"{where}[{i}]", markers)


def check_no_local_paths(plan: Sequence[PlannedFile]) -> None:
    """Refuse to publish a local absolute path in any json, card or safetensors header."""
    markers = [m for m in {str(Path.home()), os.getcwd()} if len(m) > 1]
    for f in plan:
        if f.repo_path.endswith(".json"):
            hits = find_local_paths(json.loads(f.read_bytes()), f.repo_path, markers)
        elif f.repo_path.endswith(".safetensors"):
            with safe_open(f.local, framework="numpy") as tensors:
                hits = find_local_paths(tensors.metadata() or {}, f.repo_path, markers)
        elif f.repo_path.endswith(".md"):
            text = f.read_bytes().decode("utf-8")
            hits = (f"{f.repo_path} mentions {m!r}" for m in markers if m in text)
        else:
            continue
        hit = next(iter(hits), None)
        if hit:
            raise HubError(f"refusing to publish a local path: {hit}; record a Hub id instead")


# ------------------------------------------------------------------------- errors and token


def _scrub(text: str) -> str:
    """One line, with the token (and anything shaped like one) blanked out."""
    line = " ".join(str(text).split())[:300]
    token = huggingface_hub.get_token()
    if token:
        line = line.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", line)


@contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Turn the client's errors into one scrubbed line. OSError covers the hub's own errors and
    requests-based clients; the HTTP error base of HfHubHTTPError covers httpx-style ones."""
    network = (OSError, *HfHubHTTPError.__bases__)
    try:
        yield
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise HubError(f"{what}: not found on the Hub ({_scrub(e)[:120]})") from None
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", "?")
        hint = (
            " (check HF_TOKEN / `hf auth login` and write access)" if status in (401, 403) else ""
        )
        raise HubError(f"{what}: the Hub answered HTTP {status}{hint}: {_scrub(e)}") from None
    except network as e:
        raise HubError(
            f"{what}: cannot reach the Hugging Face Hub ({type(e).__name__}: {_scrub(e)})"
        ) from None


def require_token() -> None:
    if not huggingface_hub.get_token():
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (write access)")


# ------------------------------------------------------------------------- publish


def _remote_deletions(
    api: HfApi, repo: str, remote: Sequence[str], plan: Sequence[PlannedFile], overwrite: bool
) -> list[str]:
    """Remote files to delete (only when overwriting); refuse a repo holding another dataset."""
    planned = {f.repo_path for f in plan}
    foreign = [p for p in remote if p not in REMOTE_KEEP and p not in planned]
    same = False
    if MANIFEST in remote:
        theirs = Path(api.hf_hub_download(repo, MANIFEST, repo_type="dataset")).read_bytes()
        ours = next(f for f in plan if f.repo_path == MANIFEST).read_bytes()
        same = theirs == ours
    elif not [p for p in remote if p not in (*REMOTE_KEEP, CARD)]:
        same = True  # a fresh repo (or one holding only a card): nothing of anyone's to lose
    if not same and not overwrite:
        raise HubError(
            f"{repo} already holds a different dataset (its manifest.json differs from ours); "
            "set overwrite=true to replace it, or publish to another repo"
        )
    return foreign if overwrite else []


def publish(
    repo: str,
    plan: Sequence[PlannedFile],
    *,
    private: bool,
    overwrite: bool,
    message: str,
) -> str:
    """Create the dataset repo if missing and upload the plan in one commit; returns its URL."""
    require_token()
    api = HfApi()
    with hub_errors(f"create dataset repo {repo}"):
        api.create_repo(repo, repo_type="dataset", private=private, exist_ok=True)
    with hub_errors(f"inspect {repo}"):
        info = api.dataset_info(repo)
        if private and not info.private:  # create_repo leaves an existing repo's visibility
            raise HubError(f"{repo} exists and is public: make it private on the Hub first")
        remote = [sibling.rfilename for sibling in info.siblings or []]
        deletions = _remote_deletions(api, repo, remote, plan, overwrite)
    operations: list[CommitOperationAdd | CommitOperationDelete] = [
        CommitOperationAdd(
            path_in_repo=f.repo_path,
            path_or_fileobj=f.data if f.data is not None else str(f.local),
        )
        for f in plan
    ]
    operations += [CommitOperationDelete(path_in_repo=p) for p in deletions]
    with hub_errors(f"upload to {repo}"):
        info = api.create_commit(repo, operations, commit_message=message, repo_type="dataset")
    return str(getattr(info, "commit_url", "") or f"https://huggingface.co/datasets/{repo}")


# ------------------------------------------------------------------------- pull


def count_samples(path: Path) -> int:
    """Samples in one tar = distinct keys of its file members (no image decoding)."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            return len({m.name.partition(".")[0] for m in tar if m.isfile()})
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ShardError(f"{path.name} is damaged ({e})") from e


def verify_download(folder: Path) -> Manifest:
    """A downloaded mixed/ folder is usable only if every shard matches the manifest."""
    if not is_complete(folder):
        raise ShardError(f"no {MANIFEST}: not a semix dataset, or its upload never finished")
    manifest = read_manifest(folder)
    if manifest.kind != "mixed":
        raise ShardError(f"the repo holds a {manifest.kind!r} folder, not a mixed/ dataset")
    verify_shards(folder, manifest)
    for rec in manifest.shards:
        n = count_samples(folder / rec.name)
        if n != rec.count:
            raise ShardError(f"{rec.name}: {n} samples, manifest.json says {rec.count}")
    return manifest


def _prune(folder: Path, keep: set[str]) -> None:
    """Drop what the manifest does not account for (download metadata, leftovers)."""
    for path in folder.iterdir():
        if path.name not in keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def pull(repo: str, revision: str, dest: Path, *, overwrite: bool) -> Manifest:
    """Download into `.<dest>.pull`, verify, then rename into place (nothing half-done shows)."""
    if dest.exists() and any(dest.iterdir()) and not overwrite:
        raise HubError(f"{dest} already exists; set overwrite=true to replace it, or name=other")
    tmp = dest.with_name(f".{dest.name}.pull")
    with hub_errors(f"download {repo}"):
        HfApi().snapshot_download(
            repo,
            repo_type="dataset",
            revision=revision or None,
            local_dir=tmp,
            allow_patterns=list(PULL_PATTERNS),
        )
    try:
        manifest = verify_download(tmp)
    except ShardError as e:
        shutil.rmtree(tmp)  # a corrupt download must not survive looking complete
        raise HubError(f"{repo}: {e}; the download was removed, nothing was installed") from None
    _prune(tmp, {rec.name for rec in manifest.shards} | {MANIFEST, CARD, *EXTRAS})
    old = dest.with_name(f".{dest.name}.old")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return manifest
