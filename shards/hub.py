"""The Hugging Face Hub side of a mixed/ folder: dataset card, upload plan, publish, pull.

    publish: verified folder -> card (README.md) -> plan -> create_repo + ONE create_commit
    pull:    snapshot_download into a hidden sibling -> verify every shard -> rename into place

Why one commit: a Hub commit is atomic, so a repo either holds the whole dataset, manifest
included, or nothing new; a failed upload never leaves a half-published dataset that looks
complete. It is still resumable: huggingface_hub uploads large files by content hash and skips
blobs the Hub already has, so a retry sends only what is missing, and an unchanged rerun makes
no commit at all. The client is always the real `HfApi`; the token is whatever it finds
(HF_TOKEN or the saved login). We never pass it around, and every message we raise is scrubbed.
"""

from __future__ import annotations

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
    DatasetCard,
    DatasetCardData,
    HfApi,
)
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors import safe_open

from shards.io import read_json
from shards.manifest import MANIFEST, Manifest, ShardError, read_manifest, verify_shards

CARD = "README.md"
DATA_GLOB = "mixed-*.tar"  # the card's `configs` glob: exactly the shards of a mixed/ folder
# Optional files uploaded when present. Never uploaded: config.json (it holds local paths: the
# card states the settings from the manifest instead) and .done/ (local resume bookkeeping).
EXTRAS = ("annotation.json", "annotation.png", "preview.png", "prototypes.safetensors")
EXTRAS += ("prototypes.json",)
PULL_PATTERNS = (DATA_GLOB, MANIFEST, CARD, *EXTRAS)
REMOTE_KEEP = (".gitattributes",)  # created by the Hub with the repo; not ours to delete

# Hub license ids semix may write into a card (the Hub refuses ids outside its own list).
HUB_LICENSES = ("apache-2.0", "mit", "bsd-3-clause", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0")
HUB_LICENSES += ("cc-by-nc-4.0", "cc-by-nc-sa-4.0", "openrail", "openrail++", "other")
HUB_LICENSES += ("creativeml-openrail-m", "bigscience-openrail-m")
# Known generators, matched on the lowercased model id; images follow the generator's license.
MODEL_LICENSES = {
    "stable-diffusion-v1-": "creativeml-openrail-m",  # CompVis v1-x, runwayml / sd-legacy v1-5
    "stable-diffusion-2": "openrail++",  # stabilityai 2, 2-base, 2-1, 2-1-base
    "stable-diffusion-xl": "openrail++",
    "dit-xl-2": "cc-by-nc-4.0",  # facebook/DiT-XL-2-256, -512
}
BACKEND_LICENSES = {"dit": "cc-by-nc-4.0"}  # every released DiT checkpoint is CC BY-NC 4.0
# The in-house UNet learns only from the real training set, so its images carry that license.
UNET_DATA_LICENSES = {
    "digits": (
        "cc-by-4.0",
        "scikit-learn's handwritten digits (UCI Optical Recognition of Handwritten Digits)",
    ),
}
_SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"))
_SIZES += ((1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"))
_ABSOLUTE = re.compile(r"^(/|~|[A-Za-z]:[\\/]|file:)")
_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{6,}")


class HubError(ValueError):
    """Publishing or pulling failed for a reason the user must fix; the CLI prints one line."""


# ------------------------------------------------------------------------- card metadata


def size_category(n: int) -> str:
    """The Hub's size_categories bucket for n samples."""
    return next((name for bound, name in _SIZES if n < bound), "100M<n<1B")


def license_for(generator: Mapping[str, Any], dataset: str, override: str = "") -> tuple[str, str]:
    """(Hub license id, one plain sentence for the card saying where it comes from).

    Order: the publisher's override, the license the generate stage recorded, known model ids,
    the in-house UNet's training data, the backend; otherwise `other`, said plainly.
    """
    model, backend = str(generator.get("model_id", "")), str(generator.get("backend", ""))
    if override:
        return override, f"`{override}`, set by the publisher."
    recorded = str(generator.get("license", ""))
    if recorded in HUB_LICENSES and recorded != "other":
        return recorded, f"`{recorded}`, the license of the generator `{model}`."
    for pattern, lic in MODEL_LICENSES.items():
        if pattern in model.lower():
            return lic, f"`{lic}`, the license of the generator `{model}`."
    if backend == "unet" and dataset in UNET_DATA_LICENSES:
        lic, source = UNET_DATA_LICENSES[dataset]
        return lic, f"`{lic}`: semix's in-house UNet was trained only on {source}, licensed {lic}."
    if backend in BACKEND_LICENSES:
        lic = BACKEND_LICENSES[backend]
        return lic, f"`{lic}`, the license of the {backend} backend's weights."
    return "other", (
        f"`other`: semix does not know the license of the generator `{model or backend}`. Check "
        "that model's terms before reusing these images."
    )


CITATION = """@inproceedings{luo2025beyond,
  title     = {Beyond One-Hot Labels: Semantic Mixing for Model Calibration},
  author    = {Luo, Haoyang and Tao, Linwei and Dong, Minjing and Xu, Chang},
  booktitle = {Proceedings of the 42nd International Conference on Machine Learning (ICML)},
  year      = {2025}
}"""
FIELDS = (
    ("png", "the image (RGB)"),
    ("cls", "dominant class after re-annotation: a if t_a >= 0.5 else b"),
    ("json.series, json.position", "series id; position k in the series (shared initial noise)"),
    ("json.classes, json.names", "the mixed pair [a, b] as class indices and names"),
    ("json.alpha", "generation weight of class a"),
    ("json.lambda_hat", "re-annotated weight of class a (projection on the prototypes, unclipped)"),
    ("json.soft", "training target [t_a, t_b], t_a = sigmoid(s (lambda_hat - 0.5))"),
    ("json.seed, json.generator, ...", "seed, generator id, revision, sampler, steps, guidance"),
)


def _fmt(value: Any) -> str:
    """Compact Markdown-safe rendering of a manifest value; empty -> an em dash."""
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items()) or "—"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) or "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value in (None, "") else str(value).replace("|", "/")


def _stats_lines(stats: Mapping[str, Any]) -> list[str]:
    """Annotation report (annotation.json) as prose and a per-alpha table; absent keys skipped."""
    lines = []
    if stats.get("spearman_lambda_alpha") is not None:
        lines.append(f"- Spearman correlation of λ̂ with α: {stats['spearman_lambda_alpha']:.3f}")
    if stats.get("monotone_share") is not None:
        n = stats.get("n_series_checked", "?")
        lines.append(f"- series whose λ̂ rises with α: {stats['monotone_share']:.1%} (of {n})")
    lam = stats.get("lambda_hat") or {}
    if {"mean", "std", "min", "max"} <= set(lam):
        lines.append(
            f"- λ̂ mean {lam['mean']:.3f} ± {lam['std']:.3f}, range [{lam['min']:.3f}, "
            f"{lam['max']:.3f}]; below 0: {lam.get('share_below_0', 0):.1%}, "
            f"above 1: {lam.get('share_above_1', 0):.1%}"
        )
    rows = stats.get("per_alpha") or []
    if rows:
        lines += ["", "| α | images | mean λ̂ | std λ̂ |", "|---|---|---|---|"]
        lines += [
            f"| {r['alpha']:.3g} | {r['n']} | {r['mean']:.3f} | {r['std']:.3f} |" for r in rows
        ]
    return lines


def build_card(
    manifest: Manifest,
    annotation: Mapping[str, Any] | None,
    *,
    repo: str,
    license_id: str,
    license_note: str,
    files: Sequence[str],
) -> DatasetCard:
    """The dataset card: Hub metadata through DatasetCardData, body from the manifest + report.

    `files` are the repo paths being published, so the card links only plots that exist.
    """
    info, n = manifest.info, manifest.num_samples
    gen, ann = info.get("generator", {}), info.get("annotation", {})
    name = repo.split("/")[-1]
    data = DatasetCardData(
        license=license_id,
        task_categories=["image-classification"],
        tags=["semix", "calibration", "synthetic", "soft-labels", "diffusion", "webdataset"],
        size_categories=[size_category(n)],
        pretty_name=f"{name} (semix CSM mixed data)",
        configs=[{"config_name": "default", "data_files": [{"split": "train", "path": DATA_GLOB}]}],
    )
    classes = manifest.class_names
    shown = ", ".join(classes[:20]) + (", …" if len(classes) > 20 else "")
    made = [
        ("generator", f"{_fmt(gen.get('backend'))} `{_fmt(gen.get('model_id'))}`"),
        ("revision", _fmt(gen.get("revision"))),
        ("sampler", f"{_fmt(gen.get('sampler'))}, {_fmt(gen.get('steps'))} steps"),
        ("guidance", _fmt(gen.get("guidance"))),
        ("α grid (weight of class a)", _fmt(info.get("alphas"))),
        ("series per pair", _fmt(info.get("series_per_pair"))),
        ("pairs / series", f"{_fmt(info.get('num_pairs'))} / {_fmt(info.get('num_series'))}"),
        ("image size", _fmt(info.get("image_size"))),
        ("annotation method", _fmt(ann.get("method"))),
        ("encoder", _fmt(ann.get("encoder"))),
        ("prototypes", _fmt(ann.get("prototypes"))),
        ("sharpening s", _fmt(ann.get("sharpening"))),
        ("images / shards", f"{n} / {len(manifest.shards)}"),
        ("semix version", _fmt(manifest.code_version)),
    ]
    body = [
        f"# {data.pretty_name}",
        "",
        f"{n} synthetic images made with semix by Calibration-aware "
        "Semantic Mixing (CSM): each series shares one initial noise and morphs class a into "
        "class b as the mixing weight α goes from 0 to 1; every image carries a soft label "
        f"re-annotated from image features. {len(classes)} classes: {shown}.",
        "",
        "## How it was made",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in made],
        "",
        "Settings come from `manifest.json` (`info`), which also lists every shard with its "
        "sample count and sha256. The stages' `config.json` files are not published: they hold "
        "local paths.",
    ]
    if annotation:
        body += [
            "",
            "## Annotation statistics",
            "",
            *_stats_lines(annotation.get("stats", annotation)),
        ]
    body += [f"\n![{p[:-4]}]({p})" for p in ("annotation.png", "preview.png") if p in files]
    body += ["", "## Fields", "", "| field | meaning |", "|---|---|"]
    body += [f"| `{k}` | {v} |" for k, v in FIELDS]
    body += [
        "",
        "## Load it",
        "",
        "```python",
        "from datasets import load_dataset",
        f'ds = load_dataset("{repo}", split="train")  # png, cls, json (alpha, lambda_hat, soft, ...)',
        "```",
        "",
        "```python",
        "import glob, webdataset as wds",
        "from huggingface_hub import snapshot_download",
        f'local = snapshot_download("{repo}", repo_type="dataset")',
        f'ds = wds.WebDataset(sorted(glob.glob(local + "/{DATA_GLOB}"))).decode("pil")',
        "```",
        "",
        f"With semix: `make pull REPO={repo}` verifies every shard against `manifest.json`, then "
        f"`make train MIXED=runs/{name}/mixed` trains on it.",
        "",
        "## License",
        "",
        license_note,
        "",
        "## Citation",
        "",
        "```bibtex",
        CITATION,
        "```",
    ]
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


# ------------------------------------------------------------------------- upload plan


@dataclass(frozen=True)
class PlannedFile:
    local: Path
    repo_path: str
    bytes: int


def upload_plan(folder: Path, manifest: Manifest) -> list[PlannedFile]:
    """Shards in manifest order, manifest.json, the card, then the extras that exist."""
    names = [rec.name for rec in manifest.shards] + [MANIFEST, CARD]
    names += [name for name in EXTRAS if (folder / name).is_file()]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise HubError(f"{folder} lacks {', '.join(missing)}: nothing to publish without it")
    return [PlannedFile(folder / n, n, (folder / n).stat().st_size) for n in names]


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
            hits = find_local_paths(read_json(f.local), f.repo_path, markers)
        elif f.repo_path.endswith(".safetensors"):
            with safe_open(f.local, framework="numpy") as tensors:
                hits = find_local_paths(tensors.metadata() or {}, f.repo_path, markers)
        elif f.repo_path.endswith(".md"):
            text = f.local.read_text(encoding="utf-8")
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
        ours = next(f.local for f in plan if f.repo_path == MANIFEST).read_bytes()
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
        CommitOperationAdd(path_in_repo=f.repo_path, path_or_fileobj=str(f.local)) for f in plan
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
    if not (folder / MANIFEST).is_file():
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
