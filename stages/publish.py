"""publish: runs/<classes>/mixed/ -> a dataset repo on the Hugging Face Hub.

    python -m pipeline publish --preset digits --set repo=user/semix-digits [private=1] [dry_run=1]

Only a complete, verified folder is published (every shard hashed, every sample's fields
checked). The dataset card (README.md) is built in memory and uploaded from bytes: mixed/ is a
finished folder and publish never writes into it. A dry run prints the upload plan and the card,
exactly what would go up; the upload is one atomic commit (shards/hub.py explains why that is
also resumable).
"""

from __future__ import annotations

from pathlib import Path

from core.config import ConfigError
from core.io import read_json
from core.logs import log
from core.version import code_version
from shards import hub
from shards.card import build_card, license_for
from shards.datasets import check_mixed_sample
from shards.manifest import ShardError, manifest_digest, verify_shards
from shards.reader import iter_folder
from stages.configs.publish import Config
from stages.presets import data_license

CARD_BANNER = f"--- {hub.CARD} (the dataset card, uploaded from memory) ---"


def format_plan(repo: str, plan: list[hub.PlannedFile]) -> str:
    """What would go where: one line per file (repo path, size), then the total."""
    total = sum(f.bytes for f in plan)
    lines = [f"upload plan -> hf://datasets/{repo} ({len(plan)} files, {total:,} bytes):"]
    lines += [f"  {f.repo_path:<28} {f.bytes:>14,} B" for f in plan]
    return "\n".join(lines)


def run(cfg: Config) -> Path:
    # 1. Check inputs: a repo id and a complete mixed/ folder whose shards match the manifest.
    if not cfg.repo:
        raise ConfigError(
            "publish needs repo=user/name: add it to this command's --set (make: REPO=user/name)"
        )
    folder = Path(cfg.mixed) if cfg.mixed else cfg.root / "mixed"
    manifest = verify_shards(folder)
    if manifest.kind != "mixed":
        raise ShardError(f"{folder} holds a {manifest.kind!r} folder; publish shares mixed/ only")
    for sample in iter_folder(folder, verify=False):  # hashed just above: fields only
        check_mixed_sample(sample)
    report = folder / "annotation.json"
    annotation = read_json(report) if report.is_file() else None

    # 2. The dataset card, in memory (mixed/ is complete: nothing is written into it).
    generator = manifest.info.get("generator", {})
    license_id, note = license_for(generator, data_license(cfg.preset), cfg.license)
    files = [name for name in hub.EXTRAS if (folder / name).is_file()]
    card = build_card(
        manifest, annotation, repo=cfg.repo, license_id=license_id, license_note=note, files=files
    )
    card_bytes = str(card).encode("utf-8")

    # 3. The plan: exact files and repo paths; nothing that names this machine goes up.
    plan = hub.upload_plan(folder, manifest, card_bytes)
    hub.check_no_local_paths(plan)
    print(format_plan(cfg.repo, plan))
    if cfg.dry_run:
        print(f"{CARD_BANNER}\n{card_bytes.decode('utf-8')}", end="")
        log.info("publish: dry run, card printed above, nothing uploaded or written")
        return folder

    # 4. Upload: create the repo if missing, then one commit carrying the code version.
    message = f"semix {code_version()}: {manifest.num_samples} mixed samples"
    message += f" in {len(manifest.shards)} shards (manifest {manifest_digest(folder)[:12]})"
    url = hub.publish(cfg.repo, plan, private=cfg.private, overwrite=cfg.overwrite, message=message)
    log.info("publish: %s -> %s", folder, url)
    return folder
