"""Cost of hashing shards on read (verify_sha256, on by default) in the train stage's data path.

train loads real/train (and val) into device memory once per run through the checked reader:
bytes read, size + sha256 compared with the manifest, tar parsed, PNGs decoded. This measures
that load with and without the hash, and what the hash costs the digits train data path.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from bench.bench_shards import best_of
from pipeline.registry import run_stage
from shards.datasets import load_real
from shards.manifest import read_manifest


def run() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-verify-"))
    try:
        run_stage("prepare", "digits", [f"out={tmp}"])
        folder = tmp / "digits" / "real" / "train"
        manifest = read_manifest(folder)
        size = sum(rec.bytes for rec in manifest.shards)
        load_real(folder)  # warm the page cache: both variants read from memory
        off = best_of(lambda: load_real(folder, verify=False), repeats=7)
        on = best_of(lambda: load_real(folder, verify=True), repeats=7)
        data = b"\0" * size
        sha = best_of(lambda: hashlib.sha256(data).digest(), repeats=7)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    share = (on - off) / on
    # the digits train bench: 3 epochs of 1295 images at the shard data path's step rate
    # (bench/RESULTS.md, 8,158 img/s); loading happens once per run, before the first step
    epochs_s = 3 * manifest.num_samples / 8158
    rows = [
        {
            "folder": f"digits real/train ({manifest.num_samples} images, {len(manifest.shards)} "
            f"shards, {size / 1e6:.2f} MB)",
            "load, no hash (s)": f"{off:.4f}",
            "load, sha256 (s)": f"{on:.4f}",
            "sha256 alone (s)": f"{sha:.4f}",
            "hash share of loading": f"{share:.1%}",
            "hash / 3-epoch digits run": f"{(on - off) / (epochs_s + off):.2%}",
        }
    ]
    notes = [
        "load = shards.datasets.load_real (read, check, parse, PNG decode, stack), best of 7, "
        "page cache warm; `sha256 alone` hashes the same number of bytes in memory.",
        "A training step never hashes: only the one-off load does; the last column is the "
        f"hash time over a 3-epoch digits run ({epochs_s:.2f} s of steps at 8,158 img/s) plus "
        "its load.",
    ]
    return {"title": "Hashing shards on read (verify_sha256)", "rows": rows, "notes": notes}
