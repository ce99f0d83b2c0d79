"""MaC-Cal fine-tuning math (docs/methods.md §4): a masked bottleneck head, its optimizer and
the retention schedule. FeDLaS, the other fine-tuning method, is models/fedlas.py.

Pure torch, no I/O. The finetune stage wires these parts around a classifier that exposes
`forward_features(x) -> [B, d]` and a linear `head`; see each class for its place in the loop.

MaC-Cal, one epoch t:
    head.draw_masks(q, generator)           # M ~ Bernoulli(q), W <- M ⊙ W
    for batch: loss.backward(); opt.step(); stats.update(logits, y)   # opt = MaskedSGD
    q = schedule.update(t, *stats.compute())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.config import ConfigError
from core.parts import Params, param

# ----------------------------------------------------------------------------------------------
# MaC-Cal (docs/methods.md §4)


class MaskedBottleneckHead(nn.Module):
    """s = W₂·ReLU((M₁⊙W₁)h + b₁) + b₂ with per-epoch Bernoulli masks M₁, M₂ (docs/methods.md §4).

    The masks are boolean buffers (all ones until the first `draw_masks`), so they travel with
    `.to(device)` and `state_dict`. The forward always uses M ⊙ W: because `draw_masks` zeroes
    the dropped weights and `MaskedSGD` keeps them where they are, M ⊙ W equals W, so inference
    uses the head as it is (deterministic, no 1/q rescaling), while in training the product makes
    the gradient of every dropped weight zero by the chain rule.
    """

    def __init__(
        self, d: int, num_classes: int, r: int = 256, *, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if min(d, num_classes, r) < 1:
            raise ValueError(f"d, num_classes and r must be positive, got {d}, {num_classes}, {r}")
        self.fc1 = nn.Linear(d, r)
        self.fc2 = nn.Linear(r, num_classes)
        self.register_buffer("mask1", torch.ones(r, d, dtype=torch.bool))
        self.register_buffer("mask2", torch.ones(num_classes, r, dtype=torch.bool))
        if generator is not None:
            self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """nn.Linear's default init, U(±1/√fan_in), drawn from the caller's generator."""
        for layer in (self.fc1, self.fc2):
            bound = 1.0 / math.sqrt(layer.in_features)
            layer.weight.uniform_(-bound, bound, generator=generator)
            layer.bias.uniform_(-bound, bound, generator=generator)

    def masked_weights(self) -> list[tuple[nn.Parameter, Tensor]]:
        """(weight, mask) pairs, looked up live so `MaskedSGD` sees redraws and device moves."""
        return [(self.fc1.weight, self.mask1), (self.fc2.weight, self.mask2)]

    @torch.no_grad()
    def draw_masks(self, q: float, generator: torch.Generator) -> None:
        """Draw M₁, M₂ ~ Bernoulli(q) for the coming epoch and zero the dropped weights in place.

        Masks are drawn on the generator's device and then copied, so a seed gives the same
        masks on every device. Draw order is fixed (M₁ then M₂).
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"retention q must lie in [0, 1], got {q}")
        for weight, mask in self.masked_weights():
            keep = torch.rand(mask.shape, generator=generator, device=generator.device) < q
            mask.copy_(keep)
            weight.masked_fill_(~mask, 0.0)

    def forward(self, h: Tensor) -> Tensor:
        w1 = self.fc1.weight.masked_fill(~self.mask1, 0.0)
        w2 = self.fc2.weight.masked_fill(~self.mask2, 0.0)
        return F.linear(F.relu(F.linear(h, w1, self.fc1.bias)), w2, self.fc2.bias)


class MaskedSGD(torch.optim.SGD):
    """torch SGD whose masked weights do not move at all while their mask is 0 (docs/methods.md §4).

    Why this mechanism: masking the gradient alone is not enough. With momentum, a weight dropped
    at a redraw still carries last epoch's momentum buffer, and with weight decay it is pulled by
    wd·W. Instead of re-implementing SGD with masks threaded through every term (and every torch
    code path: foreach, fused, nesterov, dampening), each step runs torch's own SGD unchanged and
    then, for every (W, M) pair given by `masked_weights()`:
      - W <- where(M, W_new, W_old): dropped entries keep their value bit for bit (a select, so
        it holds for any value, signed zeros included);
      - buf <- where(M, buf, 0): the momentum of dropped entries is zeroed, so it neither acts
        now nor revives when the weight returns (a returning weight restarts from 0 with no
        momentum, like a fresh one).
    SGD is elementwise, so kept entries follow exactly the plain-SGD trajectory (grad + wd·W,
    momentum), i.e. this equals masking the gradient, the weight-decay term and the momentum
    update of the dropped entries. Cost: one copy of W₁, W₂ per step.
    """

    def __init__(
        self,
        params: Iterable[Any],
        masked_weights: Callable[[], Iterable[tuple[Tensor, Tensor]]],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        **sgd_options: Any,
    ) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **sgd_options)
        self._masked_weights = masked_weights
        own = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(w) not in own for w, _ in masked_weights()):
            raise ValueError("every masked weight must be among the optimizer's parameters")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = list(self._masked_weights())
        before = [w.detach().clone() for w, _ in pairs]
        super().step()
        for (w, mask), w_old in zip(pairs, before):
            w.copy_(torch.where(mask, w, w_old))
            buf = self.state.get(w, {}).get("momentum_buffer")
            if buf is not None:
                buf.masked_fill_(~mask, 0.0)
        return loss


@dataclass(frozen=True)
class RetentionParams(Params):
    """The retention schedule's parameters (docs/methods.md §4; GUESS defaults): finetune's
    `maccal.<param>` leaves (config.json's `maccal_*`), also `objective.<param>=` on the command
    line."""

    q0: float = param(0.9, low=0.0, high=1.0, doc="q₀, the first epoch's retention probability")
    gamma: float = param(0.9, doc="γ: an epoch is over-confident when conf > γ·acc")
    tau0: float = param(0.1, low=0.0, doc="τ₀, the largest change of q in one epoch")
    lam: float = param(5.0, low=0.0, doc="λ: τ_t = τ₀·exp(−λ·t/T)")
    q_min: float = param(0.3, low=0.0, high=1.0, doc="q's floor")
    q_max: float = param(1.0, low=0.0, high=1.0, doc="q's ceiling")

    @classmethod
    def check_values(cls, values: Mapping[str, Any], spell: Callable[[str], str]) -> None:
        q_min, q0, q_max = values["q_min"], values["q0"], values["q_max"]
        if not q_min <= q0 <= q_max:
            names = " <= ".join(spell(n) for n in ("q_min", "q0", "q_max"))
            raise ConfigError(f"need 0 <= {names} <= 1, got {q_min}, {q0}, {q_max}")


@dataclass(frozen=True)
class MaCCalPart:
    """MaC-Cal as a part of finetune's `objective` section (core.parts.Part): its fields are
    recorded as `maccal_<param>` in every run (they are older than the parts)."""

    params: type[Params] = RetentionParams
    prefix: str = "maccal"
    every_run: bool = True


class RetentionSchedule:
    """Adaptive retention q (docs/methods.md §4): after epoch t (0-based, t < T) with acc_t, conf_t,

        τ_t = τ₀·exp(−λ·t/T),  Δ = clip(γ·acc_t − conf_t, −τ_t, τ_t),  q <- clip(q + Δ, q_min, q_max).

    An over-confident epoch (conf > γ·acc) lowers q (drop more), an under-confident one raises it;
    τ_t lets q move a lot early and settle late. `state_dict()` is JSON-able (q_trace.json, resume);
    its history numbers epochs from 1 (`epoch` = t + 1), as the logs and metrics.json do.
    """

    def __init__(
        self,
        q0: float = 0.9,
        gamma: float = 0.9,
        tau0: float = 0.1,
        lam: float = 5.0,
        q_min: float = 0.3,
        q_max: float = 1.0,
        *,
        total_epochs: int,
    ) -> None:
        if not 0.0 <= q_min <= q0 <= q_max <= 1.0:
            raise ValueError(f"need 0 <= q_min <= q0 <= q_max <= 1, got {q_min}, {q0}, {q_max}")
        if total_epochs < 1 or tau0 < 0 or lam < 0:
            raise ValueError(f"need total_epochs >= 1, tau0 >= 0, lam >= 0, got {total_epochs}")
        self.q0, self.gamma, self.tau0, self.lam = q0, gamma, tau0, lam
        self.q_min, self.q_max, self.total_epochs = q_min, q_max, total_epochs
        self.q = q0
        self.history: list[dict[str, float]] = []

    def tau(self, t: int) -> float:
        return self.tau0 * math.exp(-self.lam * t / self.total_epochs)

    def update(self, t: int, acc: float, conf: float) -> float:
        """Record epoch t (trained with the current q) and return q for epoch t + 1."""
        if not 0 <= t < self.total_epochs:
            raise ValueError(f"epoch t must lie in [0, {self.total_epochs}), got {t}")
        if not (0.0 <= acc <= 1.0 and 0.0 <= conf <= 1.0):
            raise ValueError(f"acc and conf must lie in [0, 1], got {acc}, {conf}")
        tau = self.tau(t)
        delta = min(max(self.gamma * acc - conf, -tau), tau)
        q_next = min(max(self.q + delta, self.q_min), self.q_max)
        self.history.append(
            {"epoch": t + 1, "q": self.q, "acc": acc, "conf": conf, "tau": tau, "delta": delta}
        )
        self.q = q_next
        return q_next

    def state_dict(self) -> dict[str, Any]:
        config = {k: getattr(self, k) for k in ("q0", "gamma", "tau0", "lam", "q_min", "q_max")}
        config["total_epochs"] = self.total_epochs
        return {"config": config, "q": self.q, "history": [dict(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q = float(state["q"])
        self.history = [dict(h) for h in state["history"]]


class EpochAccConf:
    """acc_t and conf_t (mean max-softmax) over one epoch's training forward passes
    (docs/methods.md §4).

    Totals stay on the logits' device (no per-step sync); `totals` = [correct, Σconf, n] in
    float64 can be all-reduced across ranks before `compute()`. Soft targets count as their argmax.
    """

    def __init__(self) -> None:
        self.totals = torch.zeros(3, dtype=torch.float64)

    def reset(self) -> None:
        self.totals = torch.zeros(3, dtype=torch.float64, device=self.totals.device)

    @torch.no_grad()
    def update(self, logits: Tensor, labels: Tensor) -> None:
        if labels.ndim == 2:
            labels = labels.argmax(dim=1)
        conf, pred = logits.detach().float().softmax(dim=-1).max(dim=-1)
        n = conf.new_full((), len(conf), dtype=torch.float64)
        batch = torch.stack([(pred == labels).sum().double(), conf.double().sum(), n])
        self.totals = self.totals.to(logits.device) + batch

    def compute(self) -> tuple[float, float]:
        correct, conf_sum, n = self.totals.tolist()
        if n == 0:
            raise ValueError("no samples accumulated this epoch")
        return correct / n, conf_sum / n
