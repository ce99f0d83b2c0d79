"""models/training.py: augmentation, batches, normalisation, eval loop, CSM sampler, objectives."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from models import training
from models.classifiers import build_classifier
from models.fedlas import FeDLaSCriterion
from models.losses import LOSSES, build_loss, mixup_batch, mixup_loss
from models.objectives import OBJECTIVES, TrainingModule, build_objective
from models.training import (
    SeriesIndex,
    channel_stats,
    collect_logits,
    csm_targets,
    epoch_batches,
    multistep_lr,
    normalize,
    random_crop_flip,
    sample_csm_members,
)
from stages.configs.train import LOSS


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_epoch_batches_cover_every_index_once_and_repeat_with_the_seed():
    batches = epoch_batches(10, 4, gen())
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(10))
    assert all(torch.equal(a, b) for a, b in zip(batches, epoch_batches(10, 4, gen())))
    # a last batch smaller than min_last is dropped (BatchNorm needs two samples per process)
    assert [len(b) for b in epoch_batches(9, 4, gen(), min_last=2)] == [4, 4]


def test_random_crop_flip_shifts_pads_with_zeros_and_flips():
    images = torch.arange(1, 2 * 6 * 6 * 3 + 1, dtype=torch.int64).view(2, 6, 6, 3) % 250 + 1
    images = images.to(torch.uint8)
    out = random_crop_flip(images, gen(3), pad=2, flip=True)
    assert out.shape == images.shape and out.dtype == torch.uint8
    assert torch.equal(out, random_crop_flip(images, gen(3), pad=2, flip=True))
    # replay the draws: every output equals the zero-padded image cropped at (dy, dx), maybe mirrored
    g = gen(3)
    dy, dx = torch.randint(0, 5, (2,), generator=g), torch.randint(0, 5, (2,), generator=g)
    mirror = torch.rand(2, generator=g) < 0.5
    padded = F.pad(images, (0, 0, 2, 2, 2, 2))
    for i in range(2):
        crop = padded[i, dy[i] : dy[i] + 6, dx[i] : dx[i] + 6]
        assert torch.equal(out[i], crop.flip(1) if mirror[i] else crop)
    assert torch.equal(random_crop_flip(images, gen(), pad=0, flip=False), images)


def test_normalize_grey_and_rgb_and_resize(monkeypatch):
    images = torch.randint(0, 256, (3, 8, 8, 3), dtype=torch.uint8)
    x = normalize(images, [0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    assert x.shape == (3, 3, 8, 8)
    assert torch.allclose(x, (images.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25)
    grey = normalize(images, [0.5], [0.25])
    assert torch.allclose(grey[:, 0], (images.float().mean(-1) / 255 - 0.5) / 0.25, atol=1e-6)
    assert normalize(images, [0.5], [0.25], image_size=16).shape == (3, 1, 16, 16)
    mean, std = channel_stats(images, 3)
    expect = images.double().div(255).reshape(-1, 3)
    assert mean == pytest.approx(expect.mean(0).tolist(), abs=1e-5)
    assert std == pytest.approx(expect.std(0, correction=0).tolist(), abs=1e-5)
    grey = images.double().div(255).mean(-1).reshape(-1)
    (g_mean,), (g_std,) = channel_stats(images, 1)
    assert (g_mean, g_std) == pytest.approx(
        (grey.mean().item(), grey.std(correction=0).item()), abs=1e-5
    )
    # exact integer sums: any chunking (reads, and blocks of arithmetic) gives the same numbers
    grey_stats = channel_stats(images, 1)
    for chunk in (1, 2, 3):
        assert channel_stats(images, 3, chunk) == (mean, std)
        assert channel_stats(images, 1, chunk) == grey_stats
    monkeypatch.setattr(training, "STATS_BLOCK_VALUES", 100)  # one image (192 values) a block
    assert channel_stats(images, 3) == (mean, std) and channel_stats(images, 1) == grey_stats


def test_multistep_lr():
    assert [multistep_lr(e, 0.1, (2, 4), 0.1) for e in range(5)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001]
    )


def test_collect_logits_equals_eval_forward_and_keeps_train_mode():
    torch.manual_seed(0)
    model = build_classifier("digits-cnn", 4, 1).train()
    images = torch.randint(0, 256, (5, 16, 16, 3), dtype=torch.uint8)
    logits, feats = collect_logits(model, images, [0.3], [0.2], batch_size=2, features=True)
    assert model.training
    with torch.no_grad():
        expect = model.eval()(normalize(images, [0.3], [0.2]))
    assert torch.allclose(logits, expect, atol=1e-5) and feats.shape == (5, model.feature_dim)


# ---------------------------------------------------------------- CSM sampler (docs/methods.md §3)


def series_table():
    """Six series of K = 5 over 4 classes; t_a falls along the series, with a twist in series 1."""
    classes = torch.tensor([[0, 1], [0, 1], [1, 2], [2, 3], [0, 3], [1, 3]])
    soft_a = torch.tensor([0.95, 0.8, 0.5, 0.2, 0.05]).repeat(6, 1)
    soft_a[1] = torch.tensor([0.6, 0.9, 0.5, 0.3, 0.02])  # best for a at position 1, b at 4
    return classes, soft_a


def test_series_index_lists_the_series_containing_each_class():
    classes, _ = series_table()
    index = SeriesIndex(classes, 5)
    assert index.counts.tolist() == [3, 4, 2, 3, 0]
    assert index.missing() == [4]
    assert sorted(index.table[1, :4].tolist()) == [0, 1, 2, 5]


def test_csm_sampler_members_positions_and_best_member():
    classes, soft_a = series_table()
    index = SeriesIndex(classes, 4)
    labels = torch.tensor([0, 1, 2, 3] * 50)
    series, pos = sample_csm_members(labels, index, soft_a, gen(1))
    assert series.shape == pos.shape == (200, 2)
    assert torch.equal(series[:, 0], series[:, 1])
    # every member comes from a series that contains the real label
    assert bool((classes[series[:, 0]] == labels[:, None]).any(dim=1).all())
    # column 1: interior positions 1..K-2, and all of them get used
    assert set(pos[:, 1].tolist()) == {1, 2, 3}
    # column 0: the member with the highest target for the real label
    for y, s, p in zip(labels.tolist(), series[:, 0].tolist(), pos[:, 0].tolist()):
        t_y = soft_a[s] if classes[s, 0] == y else 1 - soft_a[s]
        assert t_y[p] == t_y.max()
    assert pos[(series[:, 0] == 1) & (labels == 0), 0].unique().tolist() == [1]
    assert pos[(series[:, 0] == 1) & (labels == 1), 0].unique().tolist() == [4]
    # uniform over the series containing y: class 1 has four and uses them all
    assert set(series[labels == 1, 0].tolist()) == {0, 1, 2, 5}
    again = sample_csm_members(labels, index, soft_a, gen(1))
    assert torch.equal(again[0], series) and torch.equal(again[1], pos)


def test_csm_sampler_refuses_labels_without_series():
    classes, soft_a = series_table()
    with pytest.raises(ValueError, match="no complete series contains class"):
        sample_csm_members(torch.tensor([4]), SeriesIndex(classes, 5), soft_a, gen())


def test_csm_targets_put_t_a_on_a_and_the_rest_on_b():
    t = csm_targets(torch.tensor([[0, 2], [1, 3]]), torch.tensor([0.7, 0.25]), 4)
    assert torch.allclose(t, torch.tensor([[0.7, 0, 0.3, 0], [0, 0.25, 0, 0.75]]))


# ---------------------------------------------------------------- objectives


def test_objective_registry_matches_the_config_losses():
    assert set(OBJECTIVES) == set(LOSS.names)
    assert set(LOSSES) <= set(OBJECTIVES)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_objective_computes_its_loss_and_reaches_every_weight(name):
    """Each objective's loss equals its definition computed apart (the criterion of
    models.losses on the same logits; mixup on the same draws; FeDLaS' criterion on features and
    logits), and its gradient reaches every classifier weight."""
    torch.manual_seed(0)
    model = build_classifier("digits-cnn", 4, 1).eval()  # eval: the reference forward equals
    objective = build_objective(name, 4, generator=gen(), **_params(name))
    assert type(objective) is OBJECTIVES[name].objective  # the class train reads before building
    module = TrainingModule(model, objective)
    batch = {"x": torch.randn(6, 1, 16, 16), "y": torch.tensor([0, 1, 2, 3, 0, 1])}
    if objective.needs_mixed:
        batch |= {"x_syn": torch.randn(12, 1, 16, 16), "t_syn": torch.full((12, 4), 0.25)}
    prepared = objective.prepare(batch, gen(1))
    loss, logits = module(**prepared)
    loss.backward()
    assert logits.shape == (6, 4) and all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        if name == "mixup":
            x, y_a, y_b, lam = mixup_batch(batch["x"], batch["y"], 1.0, gen(1))
            expect = mixup_loss(model(x), y_a, y_b, lam)
        elif name.startswith("fedlas"):
            twin = FeDLaSCriterion(
                4, name.removeprefix("fedlas-"), generator=gen(), **_params(name)
            )
            h = model.forward_features(batch["x"])
            expect, _ = twin(h, model.head(h), batch["y"])
        elif name == "csm":
            return  # by hand below (test_csm_objective_*)
        else:
            expect = build_loss(name, 4)(model(batch["x"]), batch["y"])
    assert loss.item() == pytest.approx(expect.item(), rel=1e-6)


def _params(name: str) -> dict:
    return {"fedlas-ls": dict(alpha=0.05, beta=4.0, theta=0.95)}.get(
        name, {"fedlas-mbls": dict(alpha=0.1, beta=0.5, theta=0.95, margin=6.0)}.get(name, {})
    )


def test_csm_objective_is_ce_plus_w_times_soft_l2_with_separate_passes():
    torch.manual_seed(0)
    model = build_classifier("digits-cnn", 3, 1).eval()  # eval: BN does not mix the passes
    x, x_syn = torch.randn(4, 1, 16, 16), torch.randn(8, 1, 16, 16)
    y = torch.tensor([0, 1, 2, 0])
    t = torch.softmax(torch.randn(8, 3), dim=1)
    loss, _ = build_objective("csm", 3, weight=0.5)(
        model, {"x": x, "y": y, "x_syn": x_syn, "t_syn": t}
    )
    with torch.no_grad():
        expect = F.cross_entropy(model(x), y) + 0.5 * (
            (torch.softmax(model(x_syn), 1) - t).pow(2).sum(1).mean()
        )
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)


def test_csm_ce_ablation_is_soft_target_cross_entropy():
    torch.manual_seed(0)
    model = build_classifier("conv-mlp", 3, 1).eval()
    x, x_syn = torch.randn(4, 1, 28, 28), torch.randn(8, 1, 28, 28)
    y = torch.tensor([0, 1, 2, 0])
    t = torch.softmax(torch.randn(8, 3), dim=1)
    loss, _ = build_objective("csm", 3, weight=2.0, mixed_loss="ce")(
        model, {"x": x, "y": y, "x_syn": x_syn, "t_syn": t}
    )
    with torch.no_grad():  # −Σ_k t_k log p_k per synthetic image, batch mean
        soft_ce = -(t * torch.log_softmax(model(x_syn), 1)).sum(1).mean()
        expect = F.cross_entropy(model(x), y) + 2.0 * soft_ce
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)
    with pytest.raises(ValueError, match="mixed_loss"):
        build_objective("csm", 3, mixed_loss="kl")


def test_fedlas_gate_parameters_live_in_the_training_module():
    model = build_classifier("digits-cnn", 4, 1)
    module = TrainingModule(model, build_objective("fedlas-ls", 4, **_params("fedlas-ls")))
    gate = {id(p) for p in module.objective.criterion.gate_parameters()}
    assert gate and gate <= {id(p) for p in module.parameters()}
    assert not gate & {id(p) for p in model.parameters()}
