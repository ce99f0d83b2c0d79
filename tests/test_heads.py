"""MaC-Cal and FeDLaS math (models/heads.py, models/fedlas.py, docs/methods.md §4-§5): tiny CPU tensors only."""

from __future__ import annotations

import copy
import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from models.fedlas import (
    NCI,
    FeDLaSCriterion,
    FeDLaSGate,
    fedlas_ls_loss,
    fedlas_mbls_loss,
    smoothing_weights,
)
from models.heads import EpochAccConf, MaskedBottleneckHead, MaskedSGD, RetentionSchedule

D, C = 6, 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32)


def _train_step(head, opt, data: torch.Generator) -> None:
    h = torch.randn(16, D, generator=data)
    y = torch.randint(0, C, (16,), generator=data)
    opt.zero_grad()
    F.cross_entropy(head(h), y).backward()
    opt.step()


# ---------------------------------------------------------------------------------------- MaC-Cal


@pytest.mark.parametrize("nesterov", [False, True])
def test_masked_sgd_keeps_dropped_weights_bitwise(nesterov):
    head = MaskedBottleneckHead(D, C, r=8, generator=_gen(0))
    ref = copy.deepcopy(head)  # same head trained with plain SGD
    sgd = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": nesterov}
    opt = MaskedSGD(head.parameters(), head.masked_weights, **sgd)
    plain = torch.optim.SGD(ref.parameters(), **sgd)
    data, data_ref = _gen(1), _gen(1)
    for epoch, q in enumerate([0.5, 0.5, 0.7]):
        head.draw_masks(q, _gen(100 + epoch))
        ref.draw_masks(q, _gen(100 + epoch))
        pairs = head.masked_weights()
        start = [w.detach().clone() for w, _ in pairs]
        masks = [m.clone() for _, m in pairs]
        if epoch == 1:  # newly dropped weights still carry last epoch's momentum
            old_buf = opt.state[head.fc1.weight]["momentum_buffer"]
            assert (old_buf[~masks[0]] != 0).any()
        for _ in range(4):
            _train_step(head, opt, data)
            if epoch < 2:
                _train_step(ref, plain, data_ref)
        for (w, m), w0, m0 in zip(pairs, start, masks):
            assert torch.equal(m, m0)  # mask constant within the epoch
            assert torch.equal(_bits(w)[~m], _bits(w0)[~m])  # dropped: bit for bit
            assert (w[~m] == 0).all()
            assert (w[m] != w0[m]).any()  # kept weights do train
            assert (opt.state[w]["momentum_buffer"][~m] == 0).all()
        if epoch < 2:
            # kept weights follow plain SGD exactly; plain SGD moves dropped ones after a redraw
            for (w, m), (w_ref, _) in zip(pairs, ref.masked_weights()):
                assert torch.equal(_bits(w)[m], _bits(w_ref)[m])
            if epoch == 1:
                assert (ref.fc1.weight[~masks[0]] != 0).any()


def test_masks_redrawn_between_epochs_and_seeded():
    a = MaskedBottleneckHead(64, 10, r=256, generator=_gen(0))
    b = MaskedBottleneckHead(64, 10, r=256, generator=_gen(0))
    g = _gen(7)
    a.draw_masks(0.6, g)
    b.draw_masks(0.6, _gen(7))
    assert torch.equal(a.mask1, b.mask1) and torch.equal(a.mask2, b.mask2)
    first = a.mask1.clone()
    a.draw_masks(0.6, g)  # next epoch: same generator, advanced state
    assert not torch.equal(a.mask1, first)
    assert abs(a.mask1.float().mean().item() - 0.6) < 0.03  # Bernoulli(q)
    w_before = b.fc1.weight.detach().clone()
    b.draw_masks(0.5, _gen(8))
    assert (b.fc1.weight[~b.mask1] == 0).all()
    assert torch.equal(b.fc1.weight[b.mask1], w_before[b.mask1])
    b.draw_masks(1.0, _gen(9))
    assert b.mask1.all() and b.mask2.all()
    with pytest.raises(ValueError, match="q"):
        b.draw_masks(1.5, _gen(9))


def test_masked_sgd_rejects_foreign_weights():
    head = MaskedBottleneckHead(D, C, r=4)
    with pytest.raises(ValueError, match="masked weight"):
        MaskedSGD([head.fc1.bias], head.masked_weights, lr=0.1)


def test_inference_is_deterministic_and_unscaled():
    head = MaskedBottleneckHead(D, C, r=8, generator=_gen(0))
    opt = MaskedSGD(head.parameters(), head.masked_weights, lr=0.1, momentum=0.9)
    head.draw_masks(0.5, _gen(1))
    _train_step(head, opt, _gen(2))
    head.eval()
    h = torch.randn(5, D, generator=_gen(3))
    rng = torch.get_rng_state()
    out1, out2 = head(h), head(h)
    assert torch.equal(out1, out2) and torch.equal(rng, torch.get_rng_state())
    w1, w2 = head.fc1.weight, head.fc2.weight  # the head as it is: no mask draw, no 1/q
    manual = F.linear(F.relu(F.linear(h, w1, head.fc1.bias)), w2, head.fc2.bias)
    torch.testing.assert_close(out1, manual, rtol=0, atol=0)


def test_retention_update_clips_by_tau_and_bounds():
    s = RetentionSchedule(total_epochs=10)  # q0 0.9, γ 0.9, τ0 0.1, λ 5
    # t=0: γ·acc − conf = −0.45, clipped to −τ_0 = −0.1
    assert s.update(0, acc=0.5, conf=0.9) == pytest.approx(0.8)
    tau1 = 0.1 * math.exp(-5 * 1 / 10)
    assert s.update(1, acc=0.5, conf=0.9) == pytest.approx(0.8 - tau1)
    # t=2: +0.02 lies inside ±τ_2 ≈ 0.037, so it is not clipped
    q2 = s.update(2, acc=1.0, conf=0.88)
    assert q2 == pytest.approx(0.8 - tau1 + 0.02)
    # t=3: under-confident, clipped to +τ_3
    assert s.update(3, acc=1.0, conf=0.0) == pytest.approx(q2 + 0.1 * math.exp(-1.5))
    assert [h["epoch"] for h in s.history] == [1, 2, 3, 4]  # counted from 1, t from 0
    assert s.history[1]["tau"] == pytest.approx(tau1) and s.history[0]["q"] == 0.9

    low = RetentionSchedule(q0=0.35, total_epochs=4)
    assert low.update(0, 0.0, 1.0) == pytest.approx(0.3)
    assert low.update(1, 0.0, 1.0) == pytest.approx(0.3)  # stays at q_min
    high = RetentionSchedule(q0=0.95, total_epochs=4)
    assert high.update(0, 1.0, 0.0) == pytest.approx(1.0)  # capped at q_max

    state = json.loads(json.dumps(s.state_dict()))
    resumed = RetentionSchedule(total_epochs=10)
    resumed.load_state_dict(state)
    assert resumed.q == s.q and resumed.history == s.history
    with pytest.raises(ValueError, match="epoch"):
        s.update(10, 0.5, 0.5)
    with pytest.raises(ValueError, match="acc"):
        s.update(4, 1.5, 0.5)
    with pytest.raises(ValueError, match="q_min"):
        RetentionSchedule(q0=0.2, total_epochs=4)


def test_epoch_acc_conf():
    stats = EpochAccConf()
    stats.update(torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([0]))  # p=.75, correct
    stats.update(torch.tensor([[0.0, math.log(4.0)]]), torch.tensor([[1.0, 0.0]]))  # p=.8, wrong
    acc, conf = stats.compute()
    assert acc == pytest.approx(0.5) and conf == pytest.approx(0.775)
    stats.reset()
    with pytest.raises(ValueError):
        stats.compute()


# ----------------------------------------------------------------------------------------- FeDLaS


def _hand_ema(n: list[float], mu: float, sigma: float, th: float) -> tuple[float, float]:
    return th * statistics.mean(n) + (1 - th) * mu, th * statistics.stdev(n) + (1 - th) * sigma


def test_nci_train_updates_eval_freezes():
    nci = NCI(theta=0.5)
    z1 = torch.tensor([[1.0, -2.0, 3.0], [0.0, 4.0, 0.0], [-1.0, -1.0, -1.0]])  # n = 6, 4, 3
    z2 = torch.tensor([[10.0, 0.0, 0.0], [0.0, -30.0, 5.0]])  # n = 10, 35
    mu, sigma = 20.0, 100.0
    for z, n in [(z1, [6.0, 4.0, 3.0]), (z2, [10.0, 35.0])]:
        gamma = nci(z.requires_grad_())
        mu, sigma = _hand_ema(n, mu, sigma, 0.5)  # updated before normalising
        assert nci.mu.item() == pytest.approx(mu) and nci.sigma.item() == pytest.approx(sigma)
        expected = [(x - mu) / (sigma + 1e-3) for x in n]
        assert gamma.tolist() == pytest.approx(expected, rel=1e-6)
        assert not gamma.requires_grad
    nci.eval()
    gamma = nci(z1)
    assert nci.mu.item() == pytest.approx(mu) and nci.sigma.item() == pytest.approx(sigma)
    assert gamma.tolist() == pytest.approx([(x - mu) / (sigma + 1e-3) for x in [6, 4, 3]])
    assert set(nci.state_dict()) == {"mu", "sigma"}
    nci.train()
    nci(torch.tensor([[2.0, 2.0]]))  # one sample: μ moves, σ (no unbiased std) stays
    assert nci.mu.item() == pytest.approx(0.5 * 4 + 0.5 * mu)
    assert nci.sigma.item() == pytest.approx(sigma)


def test_gate_sign_forward_and_straight_through_gradient():
    gate = FeDLaSGate(6, generator=_gen(0))
    logits = torch.randn(5, 6, generator=_gen(1), requires_grad=True)
    psi, d = gate(logits)
    assert torch.equal(psi, torch.sign(d)) and set(psi.tolist()) <= {-1.0, 1.0}
    w = torch.randn(5, generator=_gen(2))
    loss = (torch.sin(psi) * w).sum()
    g_psi = torch.cos(psi.detach()) * w  # dL/dψ at the forward value
    expected = torch.autograd.grad(d, gate.parameters(), grad_outputs=g_psi, retain_graph=True)
    loss.backward()
    for p, g in zip(gate.parameters(), expected):
        assert p.grad is not None and p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, g)
    assert logits.grad is None  # the gate reads detached logits

    with torch.no_grad():  # π = (½, ½): d = 0 exactly, ψ = 0
        gate.mlp[2].weight.zero_()
        gate.mlp[2].bias.zero_()
    psi0, d0 = gate(logits)
    assert (d0 == 0).all() and (psi0 == 0).all()


def test_smoothing_weights_bounds():
    psi = torch.randint(-1, 2, (64,), generator=_gen(0)).float()
    # |β·γ| <= 10: beyond ~17 float32 sigmoid rounds to 0 or 1, i.e. the closed bounds
    gamma = torch.linspace(-2.5, 2.5, 64)
    r = smoothing_weights(psi, gamma, alpha=0.1, beta=4.0)
    assert (r > 0).all() and (r < 0.2).all()
    assert r[psi == 0].tolist() == pytest.approx([0.1] * int((psi == 0).sum()))
    r0 = smoothing_weights(psi, gamma, alpha=0.1, beta=0.0)
    torch.testing.assert_close(r0, torch.full_like(r0, 0.1))


def _tiny_case():
    # p₁ = (¼, ¼, ½), y₁ = 2;  p₂ = (⅗, ⅕, ⅕), y₂ = 1
    logits = torch.tensor([[0.0, 0.0, math.log(2)], [math.log(3), 0.0, 0.0]])
    return logits, torch.tensor([2, 1]), torch.tensor([0.2, 0.6])


def test_fedlas_ls_loss_by_hand():
    logits, labels, r = _tiny_case()
    ln2, ln3, ln5 = math.log(2), math.log(3), math.log(5)
    ce, uni = [ln2, ln5], [5 * ln2 / 3, (3 * ln5 - ln3) / 3]  # CE_i, −(1/C)Σ_k log p_ik
    hand = sum((1 - ri) * c + ri * u for ri, c, u in zip([0.2, 0.6], ce, uni)) / 2
    assert fedlas_ls_loss(logits, labels, r).item() == pytest.approx(hand, rel=1e-6)


def test_fedlas_mbls_loss_by_hand():
    logits, labels, r = _tiny_case()
    ln2, ln3, ln5, m = math.log(2), math.log(3), math.log(5), 0.5
    ce = [ln2, ln5]
    gaps = [2 * (ln2 - m) / 3, 2 * (ln3 - m) / 3]  # (1/C)Σ_k max(0, max_l s_l − s_k − m)
    hand = sum((1 - ri) * c for ri, c in zip([0.2, 0.6], ce)) / 2
    hand += sum(ri * g for ri, g in zip([0.2, 0.6], gaps)) / 2
    assert fedlas_mbls_loss(logits, labels, r, margin=m).item() == pytest.approx(hand, rel=1e-6)
    with pytest.raises(ValueError, match="labels"):
        fedlas_mbls_loss(logits, labels[:1], r, margin=m)


def test_fedlas_ls_with_beta_zero_is_label_smoothing():
    alpha = 0.1
    crit = FeDLaSCriterion(5, "ls", alpha=alpha, beta=0.0, theta=0.5, generator=_gen(0))
    features = torch.randn(8, 12, generator=_gen(1))
    logits = torch.randn(8, 5, generator=_gen(2))
    labels = torch.randint(0, 5, (8,), generator=_gen(3))
    loss, _ = crit(features, logits, labels)
    logp = logits.log_softmax(dim=1)
    ce = -logp[torch.arange(8), labels]
    ls = ((1 - alpha) * ce + alpha * (-logp).mean(dim=1)).mean()
    torch.testing.assert_close(loss, ls)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=alpha))


def _preset_fedlas() -> list[tuple[str, dict[str, float]]]:
    """(variant, FeDLaSCriterion kwargs) of every preset's finetune config (stages/presets:
    docs/methods.md §5's values per dataset, CIFAR-10's as the defaults), each distinct set once."""
    from pipeline.registry import resolve_stage_config
    from stages.presets import NAMES

    found: dict[str, tuple[str, dict[str, float]]] = {}
    for preset in NAMES:
        for objective in ("fedlas-ls", "fedlas-mbls"):
            cfg = resolve_stage_config("finetune", preset, ["run=x", f"objective={objective}"])
            params = cfg.objective_params()
            found.setdefault(f"{objective}{sorted(params.items())}", (objective[7:], params))
    return list(found.values())


@pytest.mark.parametrize(("variant", "params"), _preset_fedlas())
def test_criterion_defaults_stats_and_gradients(variant, params):
    crit = FeDLaSCriterion(4, variant, **params, generator=_gen(0))
    features = torch.randn(6, 8, generator=_gen(1), requires_grad=True)
    logits = torch.randn(6, 4, generator=_gen(2), requires_grad=True)
    labels = torch.randint(0, 4, (6,), generator=_gen(3))
    loss, stats = crit(features, logits, labels)
    assert stats["psi"].shape == stats["r"].shape == stats["gamma"].shape == (6,)
    assert stats["mode_share"].sum().item() == pytest.approx(1.0)
    loss.backward()
    assert logits.grad is not None and features.grad is None  # NCI reads detached features
    assert all(p.grad is not None for p in crit.gate_parameters())
    assert {id(p) for p in crit.gate_parameters()} == {id(p) for p in crit.parameters()}
    crit.eval()
    mu = crit.nci.mu.clone()
    crit(features, logits, labels)
    assert torch.equal(mu, crit.nci.mu)


def test_criterion_bad_input():
    with pytest.raises(ValueError, match="ls"):
        FeDLaSCriterion(4, "focal", alpha=0.1, beta=1.0, theta=0.5)
    with pytest.raises(ValueError, match="margin"):
        FeDLaSCriterion(4, "mbls", alpha=0.1, beta=1.0, theta=0.5)
    with pytest.raises(ValueError, match="num_classes"):
        FeDLaSGate(1)
