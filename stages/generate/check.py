"""generate, part 4: fidelity-aware series (``endpoint_check=redraw|drop``; beyond the paper).

CSM anchors each class on the pure images of its series (the α = 0 and α = 1 ends; k-way: the
lattice vertices). A series whose pure image the judge (a real-only classifier, ``train/<run>``)
does not classify as its class would teach a wrong-class image with a high soft label for the
class. With ``redraw`` such a series is drawn again from a fresh noise, seeded by (its seed, try),
at most ``endpoint_tries`` times, and dropped if it never passes; with ``drop`` it is dropped at
once. Every draw is seeded, so the shard is the same bytes on any rank and after any resume.

Each shard's counts go to ``.endpoints/<shard>.json`` before the shard itself (a rewritten shard
rewrites them identically); the manifest's info sums them (``endpoint_check``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from core.io import atomic_write_json, read_json
from core.logs import log
from core.seeding import derive_seed
from models.generators import MixSpec, SeriesSpec
from stages.common.fidelity import Judge

COUNTS = ".endpoints"  # per-shard counts, beside the shards
FIELDS = ("series", "passed", "redrawn", "dropped", "extra_draws")


def endpoints(spec: SeriesSpec | MixSpec) -> list[tuple[int, int]]:
    """(position, class) of a series' pure images: 2-way α = 0 is class b, α = 1 class a;
    k-way: every lattice vertex (a weight of 1)."""
    if isinstance(spec, SeriesSpec):
        alphas = list(spec.alphas)
        return [(alphas.index(a), c) for a, c in ((0.0, spec.class_b), (1.0, spec.class_a))]
    return [(j, spec.classes[list(w).index(1.0)]) for j, w in enumerate(spec.alphas) if 1.0 in w]


def passing(judge: Judge, specs: Sequence, images: torch.Tensor) -> list[bool]:
    """Does the judge put every pure image of each series in its class?"""
    where = [endpoints(s) for s in specs]
    pure = torch.stack([images[i, pos] for i, ends in enumerate(where) for pos, _ in ends])
    expected = torch.tensor([c for ends in where for _, c in ends])
    hit = (judge.predict(pure).cpu() == expected).tolist()
    out, at = [], 0
    for ends in where:
        out.append(all(hit[at : at + len(ends)]))
        at += len(ends)
    return out


class EndpointCheck:
    """``check(sample, specs, images)`` -> (kept specs, their images, counts)."""

    def __init__(self, mode: str, judge: Judge, tries: int) -> None:
        self.mode, self.judge, self.tries = mode, judge, tries

    def __call__(
        self, sample, specs: Sequence, images: torch.Tensor
    ) -> tuple[list, torch.Tensor, dict[str, int]]:
        ok = passing(self.judge, specs, images)
        specs, images = list(specs), images.clone()
        counts = dict.fromkeys(FIELDS, 0) | {"series": len(specs), "passed": sum(ok)}
        for attempt in range(1, self.tries + 1 if self.mode == "redraw" else 1):
            failing = [i for i, good in enumerate(ok) if not good]
            if not failing:
                break
            again = [
                replace(specs[i], seed=derive_seed(specs[i].seed, "redraw", attempt))
                for i in failing
            ]
            redrawn = sample(again)
            counts["extra_draws"] += len(again)
            for j, (i, good) in enumerate(zip(failing, passing(self.judge, again, redrawn))):
                if good:
                    specs[i], images[i], ok[i] = again[j], redrawn[j], True
                    counts["redrawn"] += 1
        keep = [i for i, good in enumerate(ok) if good]
        counts["dropped"] = len(specs) - len(keep)
        return [specs[i] for i in keep], images[keep], counts


def write_counts(folder: Path, shard: str, counts: dict[str, int]) -> None:
    atomic_write_json(folder / COUNTS / f"{Path(shard).stem}.json", counts)


def total_counts(folder: Path, shards: Sequence[str], mode: str, judge: str) -> dict[str, Any]:
    """The manifest's ``endpoint_check``: the shards' counts summed, and the shares."""
    total = dict.fromkeys(FIELDS, 0)
    for shard in shards:
        for key, value in read_json(folder / COUNTS / f"{Path(shard).stem}.json").items():
            total[key] += value
    n = max(total["series"], 1)
    log.info(
        "generate: endpoint check (%s, judge %s): %d series, %d passed at once, %d redrawn, "
        "%d dropped (%.1f %%)",
        mode, judge, total["series"], total["passed"], total["redrawn"], total["dropped"],
        100.0 * total["dropped"] / n,
    )  # fmt: skip
    return {"mode": mode, "judge": judge, **total}
