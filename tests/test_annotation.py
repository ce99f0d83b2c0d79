"""docs/methods.md §2 numerics: prototypes, λ̂ projection, soft targets, annotators, statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.annotation import (
    ANNOTATORS,
    PrototypeAccumulator,
    annotate,
    class_prototypes,
    project_lambda,
    soft_targets,
    text_prototypes,
)
from models.annotation_stats import (
    annotation_stats,
    fidelity_stats,
    monotone_share,
    rankdata,
    spearman,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- projection -------------------------------------------------------------------------------


def test_projection_pure_prototypes_midpoint_and_off_line_points():
    g = _gen()
    d, n = 16, 50
    p_a, p_b = torch.randn(d, generator=g) * 5 + 10, torch.randn(d, generator=g) * 5 + 10
    assert project_lambda(p_a[None], p_a[None], p_b[None]).item() == pytest.approx(1.0, abs=1e-6)
    assert project_lambda(p_b[None], p_a[None], p_b[None]).item() == pytest.approx(0.0, abs=1e-6)
    mid = (p_a + p_b) / 2
    assert project_lambda(mid[None], p_a[None], p_b[None]).item() == pytest.approx(0.5, abs=1e-6)

    # off-line points: a known position on the line (beyond both ends too) + orthogonal noise
    lam = torch.linspace(-0.7, 1.8, n)
    direction = p_a - p_b
    noise = torch.randn(n, d, generator=g) * 3
    noise -= (noise @ direction)[:, None] * direction / direction.dot(direction)  # ⟂ direction
    f = p_b + lam[:, None] * direction + noise
    got = project_lambda(f, p_a.expand(n, d), p_b.expand(n, d))
    torch.testing.assert_close(got, lam, atol=1e-5, rtol=0)

    # independent formula: least squares  min_λ ‖(f − p_b) − λ (p_a − p_b)‖
    f_np, a_np, b_np = f.double().numpy(), p_a.double().numpy(), p_b.double().numpy()
    for i in range(0, n, 7):
        sol, *_ = np.linalg.lstsq((a_np - b_np)[:, None], f_np[i] - b_np, rcond=None)
        assert got[i].item() == pytest.approx(sol[0], abs=1e-5)


def test_projection_of_arbitrary_points_matches_least_squares_per_row():
    g = _gen(1)
    f, p_a, p_b = (torch.randn(20, 8, generator=g) for _ in range(3))
    got = project_lambda(f, p_a, p_b).double().numpy()
    for i in range(20):
        A = (p_a[i] - p_b[i]).double().numpy()[:, None]
        sol, *_ = np.linalg.lstsq(A, (f[i] - p_b[i]).double().numpy(), rcond=None)
        assert got[i] == pytest.approx(sol[0], rel=1e-5, abs=1e-6)


def test_projection_rejects_identical_prototypes():
    p = torch.ones(3, 4)
    with pytest.raises(ValueError, match="identical prototypes"):
        project_lambda(torch.zeros(3, 4), p, p.clone())


# -- prototypes --------------------------------------------------------------------------------


def test_prototypes_equal_direct_per_class_mean():
    g = _gen(2)
    feats = torch.randn(60, 5, generator=g) * 4 + 2
    labels = torch.randint(0, 4, (60,), generator=g)
    labels[:4] = torch.arange(4)  # every class present
    protos = class_prototypes(feats, labels, 4)
    assert protos.shape == (4, 5) and protos.dtype == torch.float32
    for k in range(4):
        torch.testing.assert_close(protos[k], feats[labels == k].mean(0), atol=1e-5, rtol=1e-6)


def test_prototypes_reject_empty_class_by_name():
    feats, labels = torch.randn(6, 3), torch.tensor([0, 0, 1, 1, 3, 3])
    with pytest.raises(ValueError, match=r"classes \[2\]"):
        class_prototypes(feats, labels, 4)
    with pytest.raises(ValueError, match="labels must lie"):
        class_prototypes(feats, torch.tensor([0, 1, 2, 3, 4, 5]), 4)


def test_accumulator_over_batches_and_merge_equal_one_shot():
    g = _gen(3)
    feats = torch.randn(101, 7, generator=g)
    labels = torch.arange(101) % 5
    one_shot = class_prototypes(feats, labels, 5)
    acc = PrototypeAccumulator(5)
    for start in range(0, 101, 16):
        acc.update(feats[start : start + 16], labels[start : start + 16])
    torch.testing.assert_close(acc.prototypes(), one_shot, atol=1e-6, rtol=0)
    assert acc.counts.tolist() == torch.bincount(labels).tolist()
    left, right = PrototypeAccumulator(5, 7), PrototypeAccumulator(5, 7)  # two "ranks"
    left.update(feats[:40], labels[:40])
    right.update(feats[40:], labels[40:])
    left.merge(right)
    torch.testing.assert_close(left.prototypes(), one_shot, atol=1e-6, rtol=0)


# -- soft targets and annotators ---------------------------------------------------------------


def test_soft_targets_midpoint_symmetry_and_formula():
    x = torch.linspace(-1, 1, 21)
    for s in (2.3, 4.0):
        assert soft_targets(torch.tensor([0.5]), s).item() == pytest.approx(0.5)
        torch.testing.assert_close(
            soft_targets(0.5 + x, s) + soft_targets(0.5 - x, s), torch.ones(21)
        )
        expected = 1 / (1 + np.exp(-s * ((0.5 + x).numpy() - 0.5)))
        np.testing.assert_allclose(soft_targets(0.5 + x, s).numpy(), expected, rtol=1e-6)
        assert (soft_targets(0.5 + x, s).diff() > 0).all()
    with pytest.raises(ValueError, match="sharpening"):
        soft_targets(x, 0.0)


def _pair_setup():
    g = _gen(4)
    protos = torch.randn(3, 6, generator=g) * 3
    alphas = torch.tensor([0.0, 0.25, 0.5, 1.0])
    class_a, class_b = torch.tensor([0, 0, 2, 1]), torch.tensor([1, 2, 1, 0])
    feats = torch.randn(4, 6, generator=g) + protos[class_a]
    return feats, alphas, class_a, class_b, protos


def test_annotate_projection_equals_formula_and_ratio_returns_alpha():
    feats, alphas, a, b, protos = _pair_setup()
    lam, t = annotate("projection", feats, alphas, a, b, protos, s=4.0)
    torch.testing.assert_close(lam, project_lambda(feats, protos[a], protos[b]))
    torch.testing.assert_close(t, soft_targets(lam, 4.0))
    lam_r, t_r = annotate("ratio", None, alphas, a, b, None, s=4.0)
    torch.testing.assert_close(lam_r, alphas)
    torch.testing.assert_close(t_r, alphas)


@pytest.mark.parametrize("method", sorted(ANNOTATORS))
def test_every_annotator_keeps_its_needs_features_promise_in_both_paths(method):
    """`needs_features` tells the stage whether it may skip the encoder: a method that says False
    must run without features or prototypes, one that says True must refuse to; the 2-way and the
    k-way path (models.simplex.annotate_simplex) accept the same methods, and for k = 2 the
    k-way path gives the 2-way targets."""
    from models.simplex import annotate_simplex

    feats, alphas, a, b, protos = _pair_setup()
    weights = torch.stack([alphas, 1 - alphas], dim=1)
    classes = torch.stack([a, b], dim=1)
    if ANNOTATORS[method].needs_features:
        with pytest.raises(ValueError, match="needs features"):
            annotate(method, None, alphas, a, b, None, s=4.0)
        with pytest.raises(ValueError, match="needs features"):
            annotate_simplex(method, None, weights, classes, None, 4.0)
    else:
        annotate(method, None, alphas, a, b, None, s=4.0)
        annotate_simplex(method, None, weights, classes, None, 4.0)
    _, t = annotate(method, feats, alphas, a, b, protos, s=4.0)
    _, t_k = annotate_simplex(method, feats, weights, classes, protos, 4.0)
    torch.testing.assert_close(t_k[:, 0], t.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(t_k.sum(dim=1), torch.ones(len(t)), atol=1e-6, rtol=0)


def test_annotate_similarity_is_normalised_cosine_share():
    feats, alphas, a, b, protos = _pair_setup()
    lam, t = annotate("similarity", feats, alphas, a, b, protos, s=4.0)
    cos = torch.nn.functional.cosine_similarity
    ca, cb = cos(feats, protos[a]).clamp(min=0), cos(feats, protos[b]).clamp(min=0)
    expected = torch.where(ca + cb > 0, ca / (ca + cb), torch.full_like(ca, 0.5))
    torch.testing.assert_close(t, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(lam, t)
    # negatives: anti-aligned with p_b only -> all weight on a; anti-aligned with both -> 0.5
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    f = torch.tensor([[1.0, -1.0], [-1.0, -1.0]])
    _, t2 = annotate(
        "similarity", f, torch.zeros(2), torch.tensor([0, 0]), torch.tensor([1, 1]), p, 4.0
    )
    torch.testing.assert_close(t2, torch.tensor([1.0, 0.5]))


def test_annotate_rejects_bad_input():
    feats, alphas, a, b, protos = _pair_setup()
    with pytest.raises(ValueError, match="projection"):
        annotate("nope", feats, alphas, a, b, protos, 4.0)
    with pytest.raises(ValueError, match="two different classes"):
        annotate("projection", feats, alphas, a, a, protos, 4.0)
    with pytest.raises(ValueError, match="needs features"):
        annotate("projection", None, alphas, a, b, protos, 4.0)
    with pytest.raises(ValueError, match="class ids"):
        annotate("projection", feats, alphas, a, b + 5, protos, 4.0)


def test_sharpening_reaches_the_annotate_config_of_every_preset():
    """The annotate stage of each preset uses that preset's s (stages/presets) unless --set;
    docs/methods.md §2 fixes s = 2.3 for CIFAR-100 and 4.0 for CIFAR-10 and Tiny-ImageNet."""
    from pipeline.registry import resolve_stage_config
    from stages.presets import NAMES

    for preset in NAMES:
        assert resolve_stage_config("annotate", preset).sharpening > 0, preset
        assert resolve_stage_config("annotate", preset, ["sharpening=1.5"]).sharpening == 1.5
    paper = {"cifar10": 4.0, "cifar100": 2.3, "tiny-imagenet": 4.0}
    assert {p: resolve_stage_config("annotate", p).sharpening for p in paper} == paper


def test_rankdata_and_spearman_with_ties():
    x = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0])
    y = torch.tensor([2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0, 2.0, 8.0])
    assert rankdata(torch.tensor([10.0, 20.0, 20.0, 5.0])).tolist() == [2.0, 3.5, 3.5, 1.0]
    try:
        from scipy import stats
    except ImportError:
        stats = None
    if stats is not None:
        np.testing.assert_allclose(rankdata(x).numpy(), stats.rankdata(x.numpy()))
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy())[0], abs=1e-12)
    assert spearman(x, 2 * x + 1) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(x, torch.ones(10)) is None


def test_monotone_share_on_constructed_series():
    # 4 series of 3 + one single-image series (not checked); members shuffled on purpose
    alpha = torch.tensor([0.0, 0.5, 1.0] * 4 + [0.5])
    lam = torch.tensor(
        [
            *[0.1, 0.4, 0.9],  # increasing: monotone
            *[0.2, 0.2, 0.8],  # tie: still non-decreasing
            *[0.0, 0.7, 0.6],  # drops at the end: broken
            *[-0.2, 0.5, 1.3],  # unclipped but increasing
            0.3,
        ]
    )
    series = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4])
    perm = torch.randperm(13, generator=_gen(5))
    share, checked = monotone_share(lam[perm], alpha[perm], series[perm])
    assert checked == 4 and share == pytest.approx(0.75)
    share_rev, _ = monotone_share(-lam, alpha, series)  # decreasing in α is not "monotone" here
    assert share_rev == pytest.approx(0.0)


def test_annotation_stats_values_and_json():
    g = _gen(6)
    alphas = torch.linspace(0, 1, 4)
    pairs_per_series = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 2], [1, 2], [1, 2]])
    n_series = len(pairs_per_series)
    alpha = alphas.repeat(n_series)
    series = torch.arange(n_series).repeat_interleave(4)
    pairs = pairs_per_series.repeat_interleave(4, dim=0)
    lam = alpha + 0.05 * torch.randn(alpha.shape, generator=g)
    stats = annotation_stats(lam, alpha, series, pairs)
    json.dumps(stats, allow_nan=False)  # JSON-able, no NaN
    assert stats["n_images"] == 24 and stats["n_series"] == 6
    assert stats["n_pairs"] == 3 and stats["n_alphas"] == 4
    assert stats["spearman_lambda_alpha"] == pytest.approx(spearman(lam, alpha))
    assert stats["spearman_lambda_alpha"] > 0.8
    rows = stats["per_pair"]["1-2"]
    assert [r["alpha"] for r in rows] == pytest.approx(alphas.tolist())
    sel = (pairs[:, 0] == 1) & (pairs[:, 1] == 2) & (alpha == alphas[2])
    vals = lam[sel].double().numpy()
    assert rows[2]["n"] == 3
    assert rows[2]["mean"] == pytest.approx(vals.mean()) and rows[2]["std"] == pytest.approx(
        vals.std()
    )
    assert sum(r["n"] for r in stats["per_alpha"]) == 24
    with pytest.raises(ValueError):
        annotation_stats(lam[:0], alpha[:0], series[:0], pairs[:0])


# -- text prototypes ---------------------------------------------------------------------------


class _FakeTextEncoder:
    """encode_text = deterministic features of the prompt characters; counts calls."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def encode_text(self, prompts):
        self.prompts.extend(prompts)
        return torch.stack(
            [
                torch.tensor([len(p), sum(map(ord, p)) % 97, p.count("a")], dtype=torch.float32)
                for p in prompts
            ]
        )


def test_text_prototypes_shape_and_manual_mean():
    enc = _FakeTextEncoder()
    names, templates = ["cat", "dog", "airplane"], ("a photo of a {}.", "a {}", "art of the {}")
    protos = text_prototypes(enc, names, templates, batch_size=4)
    assert protos.shape == (3, 3)
    assert len(enc.prompts) == 9  # each prompt encoded once, in batches of 4
    for k, name in enumerate(names):
        manual = _FakeTextEncoder().encode_text([t.format(name) for t in templates]).mean(0)
        torch.testing.assert_close(protos[k], manual)
    with pytest.raises(ValueError, match="templates"):
        text_prototypes(enc, names, ("no placeholder",))


def test_endpoint_spread_and_fidelity_stats():
    # two series of 3 (α = 1, 0.5, 0): λ̂ at the endpoints is what the spread reports
    lam = torch.tensor([1.1, 0.5, -0.2, 0.7, 0.4, 0.1], dtype=torch.float64)
    alpha = torch.tensor([1.0, 0.5, 0.0] * 2, dtype=torch.float64)
    stats = annotation_stats(
        lam, alpha, torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([[0, 1]] * 6)
    )
    ends = stats["endpoints"]
    assert ends["alpha_1"]["n"] == 2 and ends["alpha_1"]["mean"] == pytest.approx(0.9)
    assert ends["alpha_1"]["min"] == pytest.approx(0.7) and ends["alpha_1"]["max"] == pytest.approx(
        1.1
    )
    assert ends["alpha_0"]["mean"] == pytest.approx(-0.05)
    assert ends["alpha_0"]["q05"] == pytest.approx(-0.2 + 0.05 * 0.3)  # linear interpolation
    json.dumps(stats)
    # fidelity: per class share of endpoint images predicted as the class they were drawn for
    expected = torch.tensor([0, 0, 0, 1, 1, 2])
    predicted = torch.tensor([0, 0, 1, 1, 1, 0])
    f = fidelity_stats(predicted, expected, ("a", "b", "c"), test_accuracy=91.0)
    assert f["accuracy"] == pytest.approx(100 * 4 / 6)
    assert f["per_class"]["a"] == {
        "n": 3,
        "accuracy": pytest.approx(100 * 2 / 3),
        "taken_for": {"b": pytest.approx(100 / 3)},
    }
    assert f["per_class"]["b"] == {"n": 2, "accuracy": 100.0}  # never mistaken: no taken_for
    assert f["per_class"]["c"]["accuracy"] == 0.0
    assert f["per_class"]["c"]["taken_for"] == {"a": 100.0}
    assert f["real_test_accuracy"] == 91.0
    with pytest.raises(ValueError, match="matching"):
        fidelity_stats(predicted[:2], expected, ("a", "b", "c"))
