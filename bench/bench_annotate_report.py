"""annotate's report on rank 0 at 100, 300 and 1,000 classes (ImageNet: 499,500 pairs x 8 α =
3,996,000 images): per-image dicts (the code before issue 15) vs compact columns (now).

Synthetic mixed json with the stage's full field set, one series per pair, K = 8, in shards of
1,000 images (125 series) as generate writes them. Each (case, path) runs in a fresh process,
and each step's peak RSS growth is its own (/proc/self/clear_refs resets the peak first):

- read: per shard, parse every sample's json (as rank 0 reads other ranks' shards back) and keep
  it: `dicts` keeps the list of dicts for the whole set (before), `columns` converts each shard
  into numpy columns at once and concatenates them (`stages.annotate.report.columns`). The
  shard's json bytes are made before the timer starts (the tar reading is the same both ways).
- stats: tensors from what the read step kept, `annotation_stats` and writing annotation.json
  (before: `annotation_stats` as it was at commit BEFORE, loaded from git, with its per-pair
  table for every pair; now: today's, a summary beyond 4,950 pairs).

The dict path runs only where it fits with room to spare for the machine's other jobs:
DICT_BYTES an image (its read and stats peaks at 300 classes) plus HEADROOM within MemAvailable.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import REPO

CASES = (100, 300, 1000)
K = 8
SHARD = 1000  # images a shard (125 series of 8)
BEFORE = "4e3990c"  # the last commit whose report read a dict per image
DICT_BYTES = 3700  # dict path, read + stats peak RSS an image (300 classes: 2.1 + 1.5 kB)
HEADROOM = 6 * 2**30


def _kib(field: str, path: str = "/proc/self/status") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _kib("VmRSS")


def _meta(s: int, k: int, a: int, b: int, alpha: float, lam: float, t: float) -> bytes:
    """canonical_json of one mixed sample's json, from a template (json.dumps per sample would
    take most of the bench's time at 1,000 classes; `_shard_json` checks that they agree)."""
    return (
        f'{{"alpha":{alpha!r},"classes":[{a},{b}],"generator":"dit:facebook/DiT-XL-2-256",'
        f'"guidance":1.0,"lambda_hat":{lam!r},"names":["n{a:08d}","n{b:08d}"],"position":{k},'
        f'"revision":null,"sampler":"ddim","seed":{2**62 + s},"series":{s},'
        f'"soft":[{t!r},{1.0 - t!r}],"steps":50}}\n'
    ).encode()


def _shard_json(classes: int, shard: int) -> list[bytes]:
    """The json bytes of mixed shard `shard` (series = pair rank, λ̂ seeded by the shard)."""
    import numpy as np

    from core.io import canonical_json
    from models.simplex import unrank_tuple

    rng = np.random.default_rng([classes, shard])
    alphas = [j / (K - 1) for j in range(K)]
    first = shard * (SHARD // K)
    series = range(first, min(first + SHARD // K, classes * (classes - 1) // 2))
    lam = (np.asarray(alphas) + rng.normal(0, 0.2, (len(series), K))).astype(np.float32)
    soft = (1 / (1 + np.exp(-4.0 * (lam.astype(np.float64) - 0.5)))).tolist()
    out = []
    for s, lam_s, soft_s in zip(series, lam.tolist(), soft):
        a, b = unrank_tuple(s, classes, 2)
        out += [_meta(s, k, a, b, alphas[k], lam_s[k], soft_s[k]) for k in range(K)]
    a, b = unrank_tuple(series[0], classes, 2)
    assert out[0] == canonical_json(json.loads(out[0]), indent=None)
    assert json.loads(out[0])["names"] == [f"n{a:08d}", f"n{b:08d}"]
    return out


def _stats_before():
    """`annotation_stats` at commit BEFORE (its models/annotation.py imports torch only)."""
    src = subprocess.run(
        ["git", "show", f"{BEFORE}:models/annotation.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    space: dict[str, Any] = {"__name__": "annotation_before"}
    exec(compile(src, f"{BEFORE}:models/annotation.py", "exec"), space)
    return space["annotation_stats"]


def child(classes: int, path: str) -> dict[str, Any]:
    import torch

    from core.io import atomic_write_json
    from models.annotation_stats import annotation_stats
    from stages.annotate.report import columns, concat_columns

    n_shards = math.ceil(classes * (classes - 1) // 2 / (SHARD // K))
    rss0, spent, kept = _reset_peak(), 0.0, []
    for i in range(n_shards):
        raw = _shard_json(classes, i)
        t0 = time.perf_counter()
        fields = [json.loads(r) for r in raw]
        kept.append(fields if path == "dicts" else columns(fields))
        spent += time.perf_counter() - t0
        del raw, fields
    t0 = time.perf_counter()
    if path == "dicts":
        fields = [f for part in kept for f in part]
    else:
        cols = concat_columns(kept)
    del kept
    spent += time.perf_counter() - t0
    read = {"s": spent, "rss_mib": (_kib("VmHWM") - rss0) / 1024}

    stats_before = _stats_before() if path == "dicts" else None
    rss0, t0 = _reset_peak(), time.perf_counter()
    if path == "dicts":  # the report's lines before issue 15
        lam = torch.tensor([f["lambda_hat"] for f in fields], dtype=torch.float64)
        alpha = torch.tensor([f["alpha"] for f in fields], dtype=torch.float64)
        series = torch.tensor([f["series"] for f in fields])
        pairs = torch.tensor([f["classes"] for f in fields])
        stats = stats_before(lam, alpha, series, pairs)
    else:
        lam, alpha = torch.from_numpy(cols.lambda_hat), torch.from_numpy(cols.mix)
        series, pairs = torch.from_numpy(cols.series), torch.from_numpy(cols.classes)
        stats = annotation_stats(lam, alpha, series, pairs)
    with tempfile.TemporaryDirectory(prefix="semix-bench-report-") as tmp:
        atomic_write_json(Path(tmp) / "annotation.json", stats)
        data = (Path(tmp) / "annotation.json").read_bytes()
    took = time.perf_counter() - t0
    return {
        "images": int(lam.numel()),
        "read": read,
        "stats": {"s": took, "rss_mib": (_kib("VmHWM") - rss0) / 1024},
        "json_bytes": len(data),
        "json_sha256": hashlib.sha256(data).hexdigest(),
        "per_pair_table": "per_pair" in stats,
    }


def _run_child(classes: int, path: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_annotate_report", json.dumps([classes, path])],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s"


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def run() -> dict:
    rows, skipped, same = [], [], []
    for classes in CASES:
        digests = []
        images = classes * (classes - 1) // 2 * K
        for path in ("dicts", "columns"):
            avail = _kib("MemAvailable", "/proc/meminfo") * 1024
            if path == "dicts" and images * DICT_BYTES + HEADROOM > avail:
                skipped.append(
                    f"{classes} classes, dicts: not run, it needs about "
                    f"{images * DICT_BYTES / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
                )
                continue
            r = _run_child(classes, path)
            digests.append(r["json_sha256"])
            if len(digests) == 2 and digests[0] == digests[1]:  # both paths ran, same bytes
                same.append(str(classes))
            rows.append({
                "classes": classes, "images": f"{r['images']:,}",
                "rank 0 holds": "a dict per image (before)" if path == "dicts" else "columns (now)",
                "read json": _fmt_s(r["read"]["s"]),
                "read RSS": f"+{r['read']['rss_mib']:,.0f} MiB",
                "stats + write": _fmt_s(r["stats"]["s"]),
                "stats RSS": f"+{r['stats']['rss_mib']:,.0f} MiB",
                "annotation.json": _size(r["json_bytes"]),
                "per-pair table": "yes" if r["per_pair_table"] else "summary",
            })  # fmt: skip
    return {
        "title": "annotate's report at 100 to 1,000 classes",
        "rows": rows,
        "notes": [
            "Synthetic mixed json (the stage's field set, one series per pair, K = 8, shards "
            "of 1,000 images); each row a fresh process. read json: parse every sample's json "
            "shard by shard and keep it (before: the dicts; now: numpy columns per shard, then "
            "concatenated), time excludes making the bytes. stats + write: the report's tensors, "
            f"annotation_stats and annotation.json (before: annotation_stats of commit {BEFORE}, "
            "grouping by unique(dim=0), the per-pair table for every pair). RSS = growth of the "
            "process's peak RSS during the step. One run each on the shared 2-core machine: "
            "times are upper bounds (an earlier run under load: 1,000 classes, columns, read "
            "174 s).",
            f"Both paths wrote the same annotation.json bytes at: {', '.join(same) or 'none'} "
            "classes (where the per-pair table is kept).",
            *skipped,
        ],
    }


if __name__ == "__main__":
    print(json.dumps(child(*json.loads(sys.argv[1]))))
