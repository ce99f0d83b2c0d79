"""What the training loop optimises: `Objective`s and the `TrainingModule` DDP wraps.

One loop (stages/loop.py) trains every classifier of semix; an objective says what one step
computes and what an epoch adds around it:

    batch = objective.prepare(batch, generator)     # on the global batch, before the rank slice
    loss, logits = objective(model, batch)          # inside the one DDP forward
    objective.observe(batch, logits)                # per-step statistics, no host sync
    stats = objective.end_epoch(epoch, model, reduce)

Train's losses (`OBJECTIVES`, one per `loss=`) compute the loss from the model and a batch dict
inside one forward call, so DDP sees a single forward per step even when CSM runs the real and
the synthetic images separately (METHODS §3), and FeDLaS' gate parameters (§5) are synchronised
with the model's. Fine-tuning is the same loop with another start and objective: FeDLaS
fine-tuning = `FeDLaSObjective` on a trained model, MaC-Cal (§4) = `MacCalObjective`, which
freezes the backbone and trains a masked bottleneck head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from models.classifiers import Classifier
from models.finetuning import GateTracker, require_separable_head
from models.heads import EpochAccConf, FeDLaSCriterion, MaskedBottleneckHead, RetentionSchedule
from models.losses import build_loss, mixup_batch, mixup_loss, soft_l2

Reduce = Callable[[Tensor], Tensor]  # sum over processes (accelerator.reduce); identity alone


class Objective(nn.Module):
    """forward(model, batch) -> (loss, logits of the real images); the hooks default to nothing.

    Hooks run outside the forward on every process, in this order per epoch: `start_epoch`,
    per step `prepare` (global batch) -> forward -> `observe`, then `end_epoch`, whose dict joins
    the epoch's history entry. State that must survive a resume and is not a parameter or
    buffer goes through `extra_state` (JSON values and tensors).
    """

    needs_mixed = False
    # `prepare` combines rows of the global batch (mixup's x[π]): a process needs every row's
    # pixels, not only its own (the streaming path then decodes the whole batch on each rank)
    mixes_rows = False

    def prepare(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        return batch

    def freeze(self, model: nn.Module) -> None:
        """Called after every `module.train()`: parts that must stay in eval mode go back."""

    def clip_parameters(self, model: nn.Module) -> Iterable[nn.Parameter]:
        """What gradient-norm clipping covers: the classifier (never FeDLaS' gate, METHODS §5)."""
        return model.parameters()

    def start_epoch(self, epoch: int, model: nn.Module, draw: Callable[[str], torch.Generator]):
        """`draw(purpose)`: a CPU generator of this epoch for that purpose."""

    def observe(self, batch: dict[str, Any], logits: Tensor) -> None:
        pass

    def end_epoch(self, epoch: int, model: nn.Module, reduce: Reduce) -> dict[str, Any]:
        return {}

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


class CriterionObjective(Objective):
    """Any `models.losses` criterion on the real batch: ce, ls, focal, flsd53, mbls, mmce."""

    def __init__(self, criterion: nn.Module) -> None:
        super().__init__()
        self.criterion = criterion

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        logits = model(batch["x"])
        return self.criterion(logits, batch["y"]), logits


class MixupObjective(Objective):
    """Mixup (METHODS §6): x̃ = λx + (1−λ)x[π] in `prepare`, λ·CE(y) + (1−λ)·CE(y[π])."""

    mixes_rows = True

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        if alpha <= 0:
            raise ValueError(f"mixup alpha must be > 0, got {alpha}")
        self.alpha = alpha

    def prepare(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        x, y_a, y_b, lam = mixup_batch(batch["x"], batch["y"], self.alpha, generator)
        return {**batch, "x": x, "y": y_a, "y_b": y_b, "lam": lam}

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        logits = model(batch["x"])
        return mixup_loss(logits, batch["y"], batch["y_b"], batch["lam"]), logits


MIXED_LOSSES = ("l2", "ce")


class CSMObjective(Objective):
    """CE(real) + w·mean_j ||softmax(s̃_j) − t_j||² on the synthetic batch (METHODS §3).

    Real and synthetic images take separate forward passes, so BatchNorm normalises each with
    its own batch statistics, as the reference code does. `mixed_loss="ce"` is the paper's
    ablation: soft-target cross-entropy −Σ_k t_k log p_k instead of the L2 term.
    """

    needs_mixed = True

    def __init__(self, weight: float = 1.0, mixed_loss: str = "l2") -> None:
        super().__init__()
        if weight < 0:
            raise ValueError(f"csm weight must be >= 0, got {weight}")
        if mixed_loss not in MIXED_LOSSES:
            raise ValueError(f"csm mixed_loss must be one of {MIXED_LOSSES}, got {mixed_loss!r}")
        self.weight, self.mixed_loss = weight, mixed_loss

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        logits = model(batch["x"])
        synthetic = model(batch["x_syn"]).float()
        if self.mixed_loss == "l2":
            mixed = soft_l2(synthetic, batch["t_syn"])
        else:  # F.cross_entropy takes probability targets: −Σ_k t_k log p_k, batch mean
            mixed = F.cross_entropy(synthetic, batch["t_syn"])
        return F.cross_entropy(logits, batch["y"]) + self.weight * mixed, logits


class FeDLaSObjective(Objective):
    """FeDLaS-LS / -MbLS (METHODS §5) on pooled features + logits of the real batch, from
    scratch (train loss=fedlas-*) or on a trained model (finetune method=fedlas-*).

    Per epoch: mean r, the NCI's μ and σ and, with `num_samples` > 0 (the batch carries the
    dataset indices `idx`), each gate mode's share and the flip rate (`GateTracker`).
    """

    def __init__(self, criterion: FeDLaSCriterion, num_samples: int = 0) -> None:
        super().__init__()
        self.criterion = criterion
        self.tracker = GateTracker(num_samples) if num_samples > 0 else None
        self._step: dict[str, Tensor] = {}
        self._sums: Tensor | None = None  # Σr, n on the device

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        h = model.forward_features(batch["x"])
        logits = model.head(h)
        loss, self._step = self.criterion(h.float(), logits.float(), batch["y"])
        return loss, logits

    def start_epoch(self, epoch: int, model: nn.Module, draw) -> None:
        self._sums = None

    def observe(self, batch: dict[str, Any], logits: Tensor) -> None:
        r = self._step["r"]
        step = torch.stack([r.sum().double(), r.new_tensor(float(r.numel()), dtype=torch.float64)])
        self._sums = step if self._sums is None else self._sums + step
        if self.tracker is not None:
            self.tracker.update(batch["idx"], self._step["psi"])

    def end_epoch(self, epoch: int, model: nn.Module, reduce: Reduce) -> dict[str, Any]:
        r_sum, n = reduce(self._sums).tolist()
        stats = {
            "r_mean": r_sum / n,
            "nci_mu": float(self.criterion.nci.mu),
            "nci_sigma": float(self.criterion.nci.sigma),
        }
        if self.tracker is not None:
            stats |= self.tracker.end_epoch(reduce)  # mode_share {+1, -1, 0}, flip_rate
        return stats

    def extra_state(self) -> dict[str, Any]:
        return self.tracker.state_dict() if self.tracker is not None else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.load_state_dict(state)


class MacCalObjective(Objective):
    """MaC-Cal (METHODS §4): the backbone frozen in eval mode (no grads, BatchNorm statistics as
    trained), a fresh masked bottleneck head trained with cross-entropy, one Bernoulli(q) mask
    per epoch, q <- RetentionSchedule(acc_t, conf_t) after it. No gradient clipping.

    `features` [N, d]: the un-augmented features of the training set, computed once by the
    caller when there is no augmentation (the batch's `idx` picks them); else the frozen
    backbone runs, without gradients, on every augmented batch.
    """

    def __init__(self, schedule: RetentionSchedule, features: Tensor | None = None) -> None:
        super().__init__()
        self.schedule = schedule
        self.features = features
        self.stats = EpochAccConf()

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            if self.features is not None:
                h = self.features[batch["idx"].to(self.features.device)]
            else:
                h = model.forward_features(batch["x"])
        logits = model.head(h.float())
        return F.cross_entropy(logits, batch["y"]), logits

    def freeze(self, model: nn.Module) -> None:
        model.eval()  # the head has neither dropout nor BatchNorm: eval mode changes nothing

    def clip_parameters(self, model: nn.Module) -> Iterable[nn.Parameter]:
        return []

    def start_epoch(self, epoch: int, model: nn.Module, draw) -> None:
        model.head.draw_masks(self.schedule.q, draw("mask"))  # M ~ Bernoulli(q), W <- M ⊙ W
        self.stats.reset()

    def observe(self, batch: dict[str, Any], logits: Tensor) -> None:
        self.stats.update(logits, batch["y"])

    def end_epoch(self, epoch: int, model: nn.Module, reduce: Reduce) -> dict[str, Any]:
        self.stats.totals = reduce(self.stats.totals)
        acc, conf = self.stats.compute()
        q = self.schedule.q
        self.schedule.update(epoch, acc, conf)  # q for the next epoch
        head = model.head
        return {
            "train_acc": 100.0 * acc,
            "train_conf": 100.0 * conf,
            "q": q,
            "q_next": self.schedule.q,
            "tau": self.schedule.history[-1]["tau"],
            "kept": {
                "w1": float(head.mask1.float().mean()),
                "w2": float(head.mask2.float().mean()),
            },
        }

    def extra_state(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])


def maccal(
    model: Classifier,
    r: int,
    schedule: RetentionSchedule,
    generator: torch.Generator,
    features: Tensor | None = None,
) -> MacCalObjective:
    """Freeze `model`, give it a fresh `MaskedBottleneckHead` (init from `generator`), return
    the objective. The head is the model's (saved with it), not the objective's."""
    require_separable_head(model)
    model.requires_grad_(False)
    device = next(model.parameters()).device
    head = MaskedBottleneckHead(model.feature_dim, model.num_classes, r, generator=generator)
    model.head = head.to(device)
    return MacCalObjective(schedule, features)


def _criterion(name: str) -> Callable[..., Objective]:
    return lambda num_classes, generator=None, num_samples=0, **p: CriterionObjective(
        build_loss(name, num_classes, **p)
    )


def _fedlas(variant: str) -> Callable[..., Objective]:
    return lambda num_classes, generator=None, num_samples=0, **p: FeDLaSObjective(
        FeDLaSCriterion(num_classes, variant, generator=generator, **p), num_samples
    )


# loss name -> factory(num_classes, generator=None, num_samples=0, **params). Params: docs/train.md.
OBJECTIVES: dict[str, Callable[..., Objective]] = {
    **{
        name: _criterion(name)
        for name in ("ce", "ls", "focal", "flsd53", "mbls", "mmce", "mmce_weighted")
    },
    "mixup": lambda num_classes, generator=None, num_samples=0, **p: MixupObjective(**p),
    "csm": lambda num_classes, generator=None, num_samples=0, **p: CSMObjective(**p),
    "fedlas-ls": _fedlas("ls"),
    "fedlas-mbls": _fedlas("mbls"),
}


def build_objective(
    name: str,
    num_classes: int,
    generator: torch.Generator | None = None,
    num_samples: int = 0,
    **params: Any,
) -> Objective:
    """`generator`: initial draws (FeDLaS' gate); `num_samples`: training-set size, for
    objectives that keep per-sample statistics (FeDLaS' gate flips)."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown loss {name!r}; valid: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](num_classes, generator=generator, num_samples=num_samples, **params)


class TrainingModule(nn.Module):
    """model + objective as one module: what DDP wraps and the checkpoint holds.

    forward(**batch) -> (loss, logits). `model` is the classifier (final weights); the objective
    may own parameters (FeDLaS gate) that train with it but stay out of gradient clipping.
    """

    def __init__(self, model: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, **batch: Any) -> tuple[Tensor, Tensor]:
        return self.objective(self.model, batch)

    def train(self, mode: bool = True) -> TrainingModule:
        super().train(mode)
        if mode:
            self.objective.freeze(self.model)
        return self
