"""annotate's report at any size (issue 15): rank 0 holds compact columns, not a dict per image,
and annotation.json stays small when the pairs are many.

The stage's bytes for digits (k = 2) and k = 3 are pinned in tests/test_kway.py; here the
columns are checked against the per-image dict path they replaced, value for value.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from models.annotation_stats import PER_PAIR_CAP, annotation_stats
from models.simplex import edge_monotone_share, lattice_points, lattice_weights, simplex_stats
from stages.annotate.report import columns, concat_columns


def _pair_fields(n_classes: int, alphas: list[float], rng: random.Random) -> list[dict]:
    """Mixed json of one series per pair (a < b), shuffled λ̂, all of the real field set."""
    out = []
    s = 0
    for a in range(n_classes):
        for b in range(a + 1, n_classes):
            for k, alpha in enumerate(alphas):
                lam = float(np.float32(alpha + rng.gauss(0, 0.2)))  # λ̂ is float32 in the json
                out.append({
                    "series": s, "position": k, "classes": [a, b], "names": [str(a), str(b)],
                    "alpha": alpha, "seed": rng.getrandbits(63), "generator": "unet:x",
                    "lambda_hat": lam, "soft": [0.5, 0.5],
                })  # fmt: skip
            s += 1
    return out


def _kway_fields(n_series: int, rng: random.Random) -> list[dict]:
    weights = lattice_weights(3, 2)
    out = []
    for s in range(n_series):
        classes = sorted(rng.sample(range(10), 3))
        for k, w in enumerate(weights):
            lam = [float(np.float32(x + rng.gauss(0, 0.1))) for x in w]
            out.append({
                "series": s, "position": k, "classes": classes, "weights": list(w),
                "lambda_hat": lam, "soft": [1 / 3] * 3,
            })  # fmt: skip
    return out


def _shards(fields: list[dict], per: int) -> list[list[dict]]:
    return [fields[i : i + per] for i in range(0, len(fields), per)]


def _via_json(shard: list[dict]) -> list[dict]:
    """As rank 0 reads another rank's shard back: json text, parsed."""
    return [json.loads(json.dumps(f)) for f in shard]


def test_pair_columns_give_the_dict_path_stats_exactly():
    fields = _pair_fields(7, [0.0, 1 / 3, 2 / 3, 1.0], random.Random(0))
    # the per-image dict path the stage used before: tensors straight from the list of dicts
    old = annotation_stats(
        torch.tensor([f["lambda_hat"] for f in fields], dtype=torch.float64),
        torch.tensor([f["alpha"] for f in fields], dtype=torch.float64),
        torch.tensor([f["series"] for f in fields]),
        torch.tensor([f["classes"] for f in fields]),
    )
    parts = [columns(_via_json(s) if i % 2 else s) for i, s in enumerate(_shards(fields, 10))]
    cols = concat_columns(parts)
    assert not cols.kway and cols.n_images == len(fields) == 84
    assert cols.lambda_hat.dtype == np.float64 and cols.classes.dtype == np.int32
    assert cols.series.dtype == cols.position.dtype == np.int64
    assert cols.classes.shape == (84, 2) and cols.mix.shape == (84,)
    new = annotation_stats(
        torch.from_numpy(cols.lambda_hat),
        torch.from_numpy(cols.mix),
        torch.from_numpy(cols.series),
        torch.from_numpy(cols.classes),
    )
    assert json.dumps(new) == json.dumps(old)  # same keys, order and float bits
    assert new["n_pairs"] == 21 and len(new["per_pair"]) == 21


def test_kway_columns_give_the_dict_path_stats_exactly():
    fields = _kway_fields(9, random.Random(1))
    points = lattice_points(3, 2)
    old = simplex_stats(
        torch.tensor([f["lambda_hat"] for f in fields], dtype=torch.float64),
        torch.tensor([f["weights"] for f in fields], dtype=torch.float64),
        torch.tensor([f["series"] for f in fields]),
        torch.tensor([f["position"] for f in fields]),
        points,
    )
    cols = concat_columns([columns(_via_json(s)) for s in _shards(fields, 12)])
    assert cols.kway and cols.lambda_hat.shape == cols.mix.shape == cols.classes.shape == (54, 3)
    new = simplex_stats(
        torch.from_numpy(cols.lambda_hat),
        torch.from_numpy(cols.mix),
        torch.from_numpy(cols.series),
        torch.from_numpy(cols.position),
        points,
    )
    assert json.dumps(new) == json.dumps(old)
    assert new["n_series_checked"] == 9


def _edge_share_by_dicts(lam, series, positions, points):
    """The dict-per-series implementation the sorted columns replaced (reference)."""
    from models.simplex import lattice_edges

    by_series: dict[int, dict[int, torch.Tensor]] = {}
    for sid, pos, row in zip(series.tolist(), positions.tolist(), lam.double()):
        by_series.setdefault(sid, {})[pos] = row
    complete = [m for m in by_series.values() if len(m) == len(points)]
    if not complete:
        return None, 0
    t = torch.stack([torch.stack([m[p] for p in range(len(points))]) for m in complete])
    p, q, i, j = torch.tensor(lattice_edges(points)).T
    follows = ((t[:, q, i] - t[:, q, j]) >= (t[:, p, i] - t[:, p, j])).all(dim=1)
    return float(follows.double().mean()), len(complete)


def test_edge_monotone_share_matches_the_dict_version_on_messy_input():
    g = torch.Generator().manual_seed(3)
    points = lattice_points(3, 2)
    w = torch.tensor(lattice_weights(3, 2))
    # 40 series, shuffled; some incomplete (a point missing), some with a repeated point
    series = torch.arange(40).repeat_interleave(6)
    positions = torch.arange(6).repeat(40)
    lam = w.repeat(40, 1) + 0.3 * torch.randn(240, 3, generator=g, dtype=torch.float64)
    keep = torch.ones(240, dtype=torch.bool)
    keep[torch.tensor([6 * 3 + 2, 6 * 11 + 0, 6 * 25 + 5])] = False  # series 3, 11, 25 broken
    dup = torch.tensor([6 * 7 + 1, 6 * 30 + 4])  # series 7 and 30: a point twice
    series = torch.cat([series[keep], series[dup]])
    positions = torch.cat([positions[keep], positions[dup]])
    lam = torch.cat([lam[keep], lam[dup] + torch.tensor([3.0, -3.0, 0.0])])  # a copy that breaks
    perm = torch.randperm(len(series), generator=g)
    got = []
    for order in (perm, perm.flip(0)):  # which copy of a repeated point comes last differs
        got.append(edge_monotone_share(lam[order], series[order], positions[order], points))
        assert got[-1] == _edge_share_by_dicts(lam[order], series[order], positions[order], points)
        assert got[-1][1] == 37 and 0 < got[-1][0] < 1
    assert got[0] != got[1]
    assert edge_monotone_share(lam[:3], series[:3], positions[:3], points) == (None, 0)
    with pytest.raises(ValueError, match="positions"):
        edge_monotone_share(lam[:2], series[:2], torch.tensor([0, 6]), points)


def test_per_pair_table_up_to_the_cap_then_a_summary():
    rng = random.Random(2)
    # all pairs of 100 classes (CIFAR-100) keep the table; 101 classes are past the cap
    for n_classes, table in ((100, True), (101, False)):
        cols = columns(_pair_fields(n_classes, [0.0, 1.0], rng))
        stats = annotation_stats(
            *(torch.from_numpy(c) for c in (cols.lambda_hat, cols.mix, cols.series, cols.classes))
        )
        pairs = n_classes * (n_classes - 1) // 2
        assert stats["n_pairs"] == pairs and ("per_pair" in stats) == table
        if table:
            assert pairs == PER_PAIR_CAP and "per_pair_omitted" not in stats
        else:
            assert stats["per_pair_omitted"] == {"pairs": pairs, "cap": PER_PAIR_CAP}
            assert [r["alpha"] for r in stats["per_pair_summary"]] == [0.0, 1.0]
            assert len(json.dumps(stats)) < 5000  # the 5,050-pair table would be ~700 kB


def test_per_pair_summary_is_the_spread_of_the_pair_means():
    # 3 pairs x 2 α, two series per pair: per-pair means at α = 1 are 0.9, 0.6, 1.2
    pairs = torch.tensor([[0, 1], [0, 2], [1, 2]]).repeat_interleave(4, dim=0)
    alpha = torch.tensor([0.0, 1.0] * 6, dtype=torch.float64)
    series = torch.arange(6).repeat_interleave(2)
    lam = torch.tensor(
        [0.1, 0.8, -0.1, 1.0, 0.0, 0.5, 0.2, 0.7, 0.3, 1.1, 0.1, 1.3], dtype=torch.float64
    )
    full = annotation_stats(lam, alpha, series, pairs, per_pair_cap=None)
    short = annotation_stats(lam, alpha, series, pairs, per_pair_cap=2)
    assert short["per_pair_omitted"] == {"pairs": 3, "cap": 2} and "per_pair" not in short
    at_1 = short["per_pair_summary"][1]
    means = [rows[1]["mean"] for rows in full["per_pair"].values()]
    assert means == pytest.approx([0.9, 0.6, 1.2])
    assert at_1["alpha"] == 1.0 and at_1["pairs"] == 3
    assert at_1["min"] == pytest.approx(0.6) and at_1["max"] == pytest.approx(1.2)
    assert at_1["median"] == pytest.approx(0.9)
    assert at_1["q25"] == pytest.approx(np.quantile(means, 0.25))
    assert at_1["q95"] == pytest.approx(np.quantile(means, 0.95))
    # everything else is the same as with the table
    drop = ("per_pair", "per_pair_omitted", "per_pair_summary")
    assert {k: v for k, v in full.items() if k not in drop} == {
        k: v for k, v in short.items() if k not in drop
    }


def test_grouping_by_row_codes_is_unique_over_rows():
    from models.annotation_stats import _group_mean_std

    g = torch.Generator().manual_seed(4)
    keys = torch.stack(
        [torch.randint(-3, 40, (500,), generator=g), torch.randint(0, 7, (500,), generator=g)], 1
    )
    values = torch.randn(500, generator=g, dtype=torch.float64)
    uniq, inverse, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    mean = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, values) / counts
    got = _group_mean_std(values, keys)
    assert torch.equal(got[0], uniq) and torch.equal(got[1], counts)
    assert torch.equal(got[2], mean)  # the same sums in the same order: the same bits
