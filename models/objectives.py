"""What the training loop optimises: `Objective`s and the `TrainingModule` DDP wraps.

One loop (stages/common/epochs.py) trains every classifier of semix; an objective says what one step
computes and what an epoch adds around it:

    batch = objective.prepare(batch, generator)     # on the global batch, before the rank slice
    loss, logits = objective(model, batch)          # inside the one DDP forward
    objective.observe(batch, logits)                # per-step statistics, no host sync
    stats = objective.end_epoch(epoch, model, reduce)

Train's losses (`OBJECTIVES`, one entry per `loss=`: its parameters, a frozen dataclass, and how
to build its objective; `register_loss` adds one from outside semix) compute the loss from the
model and a batch dict inside one forward call, so DDP sees a single forward per step even when CSM runs the real and
the synthetic images separately (docs/methods.md §3), and FeDLaS' gate parameters (§5) are synchronised
with the model's. Fine-tuning is the same loop with another start and objective: FeDLaS
fine-tuning = `FeDLaSObjective` on a trained model, MaC-Cal (§4) = `MacCalObjective`, which
freezes the backbone and trains a masked bottleneck head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from core.config import ConfigError
from core.parts import Params, param
from models.classifiers import Classifier
from models.fedlas import FeDLaSCriterion
from models.finetuning import GateTracker, require_separable_head
from models.heads import EpochAccConf, MaskedBottleneckHead, RetentionSchedule
from models.losses import LOSSES, mixup_batch, mixup_loss, soft_l2

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
        """What gradient-norm clipping covers: the classifier (never FeDLaS' gate, docs/methods.md §5)."""
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
    """Mixup (docs/methods.md §6): x̃ = λx + (1−λ)x[π] in `prepare`, λ·CE(y) + (1−λ)·CE(y[π])."""

    mixes_rows = True

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(1.0, doc="Beta(α, α); GUESS (Zhang et al.'s CIFAR value)")

    def __init__(self, params: Params | None = None) -> None:
        super().__init__()
        self.alpha = (params or self.Params()).alpha
        if self.alpha <= 0:  # Beta(0, 0) is no distribution; an open bound, so checked here
            raise ValueError(f"mixup alpha must be > 0, got {self.alpha}")

    def prepare(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        x, y_a, y_b, lam = mixup_batch(batch["x"], batch["y"], self.alpha, generator)
        return {**batch, "x": x, "y": y_a, "y_b": y_b, "lam": lam}

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        logits = model(batch["x"])
        return mixup_loss(logits, batch["y"], batch["y_b"], batch["lam"]), logits


# the heading --fields shows above csm's targets
ABLATIONS = (
    'the paper\'s ablations: targets "ratio" = t_a = α (no re-annotation); mixed loss "ce" = '
    "soft-target cross-entropy instead of L2"
)


class CSMObjective(Objective):
    """CE(real) + w·mean_j ||softmax(s̃_j) − t_j||² on the synthetic batch (docs/methods.md §3).

    Real and synthetic images take separate forward passes, so BatchNorm normalises each with
    its own batch statistics, as the reference code does. `mixed_loss="ce"` is the paper's
    ablation: soft-target cross-entropy −Σ_k t_k log p_k instead of the L2 term. `sharpening`
    and `targets` say how the train stage makes the targets t when it loads mixed/.
    """

    needs_mixed = True

    @dataclass(frozen=True)
    class Params(Params):
        weight: float = param(1.0, low=0.0, doc="w of the synthetic term (reference: 1)")
        sharpening: float = param(
            0.0,
            low=0.0,
            data=True,
            doc="s > 0: t_a = sigmoid(s(λ̂ − 0.5)) at load; 0: the stored soft",
        )
        targets: Literal["soft", "ratio"] = param(
            "soft", data=True, doc="soft | ratio", section=ABLATIONS
        )
        mixed_loss: Literal["l2", "ce"] = param("l2", doc="l2 | ce")

    def __init__(self, params: Params | None = None) -> None:
        super().__init__()
        params = params or self.Params()
        self.weight, self.mixed_loss = params.weight, params.mixed_loss

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        logits = model(batch["x"])
        synthetic = model(batch["x_syn"]).float()
        if self.mixed_loss == "l2":
            mixed = soft_l2(synthetic, batch["t_syn"])
        else:  # F.cross_entropy takes probability targets: −Σ_k t_k log p_k, batch mean
            mixed = F.cross_entropy(synthetic, batch["t_syn"])
        return F.cross_entropy(logits, batch["y"]) + self.weight * mixed, logits


THETA = "FeDLaS (both variants): the NCI's EMA weight θ"


@dataclass(frozen=True)
class FeDLaSLS(Params):
    """FeDLaS-LS' parameters; the defaults are docs/methods.md §5's CIFAR-10 values (the presets give
    the other datasets' theirs)."""

    alpha: float = param(0.05, low=0.0, doc="FeDLaS-LS: α of r_i = 2α·sigmoid(β·ψ_i·γ_i)")
    beta: float = param(4.0, doc="FeDLaS-LS: β of r_i")
    theta: float = param(0.95, field="fedlas_theta", doc=THETA)


@dataclass(frozen=True)
class FeDLaSMbLS(Params):
    alpha: float = param(0.1, low=0.0, doc="FeDLaS-MbLS: α of r_i = 2α·sigmoid(β·ψ_i·γ_i)")
    beta: float = param(0.5, doc="FeDLaS-MbLS: β of r_i")
    margin: float = param(6.0, field="fedlas_margin", doc="FeDLaS-MbLS: the logit-gap margin m")
    theta: float = param(0.95, field="fedlas_theta", doc=THETA)


class FeDLaSObjective(Objective):
    """FeDLaS-LS / -MbLS (docs/methods.md §5) on pooled features + logits of the real batch, from
    scratch (train loss=fedlas-*) or on a trained model (finetune objective=fedlas-*).

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
    """MaC-Cal (docs/methods.md §4): the backbone frozen in eval mode (no grads, BatchNorm statistics as
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


# ---------------------------------------------------------------- the registry

Build = Callable[[Any, int, "torch.Generator | None", int], Objective]


@dataclass(frozen=True)
class LossEntry:
    """One train loss: `params`, its frozen Params dataclass (the train config's fields derive
    from it: core/parts.py), and `build(params, num_classes, generator, num_samples)`, its
    objective (`generator`: initial draws such as FeDLaS' gate; `num_samples`: the training set's
    size, for per-sample statistics). `prefix`: its fields' `<prefix>_<param>`; `every_run`:
    see core.parts.Part; `objective`: the class `build` returns, whose class-level `needs_mixed`
    and `mixes_rows` say how the stage loads the data before any objective is built."""

    params: type[Params]
    build: Build
    prefix: str
    every_run: bool = False
    objective: type[Objective] = Objective


def criterion(loss: type[nn.Module]) -> Build:
    """The builder of a (logits, labels) loss class `loss(num_classes, params)`: it runs on the
    real batch (CriterionObjective)."""
    return lambda params, num_classes, generator, num_samples: CriterionObjective(
        loss(num_classes, params)
    )


def _fedlas(variant: str) -> Build:
    return lambda params, num_classes, generator, num_samples: FeDLaSObjective(
        FeDLaSCriterion(num_classes, variant, generator=generator, **asdict(params)), num_samples
    )


# loss name -> its entry, in the order --help lists them. These are the losses config.json has
# recorded from the first runs (every_run): a loss added since records its fields only off their
# defaults, so no run recorded before changes its identity. Parameters: docs/train.md.
OBJECTIVES: dict[str, LossEntry] = {
    **{
        name: LossEntry(
            cls.Params, criterion(cls), getattr(cls, "prefix", name), True, CriterionObjective
        )
        for name, cls in LOSSES.items()
    },
    "mixup": LossEntry(
        MixupObjective.Params, lambda p, *_: MixupObjective(p), "mixup", True, MixupObjective
    ),
    "csm": LossEntry(CSMObjective.Params, lambda p, *_: CSMObjective(p), "csm", True, CSMObjective),
    "fedlas-ls": LossEntry(FeDLaSLS, _fedlas("ls"), "fedlas_ls", True, FeDLaSObjective),
    "fedlas-mbls": LossEntry(FeDLaSMbLS, _fedlas("mbls"), "fedlas_mbls", True, FeDLaSObjective),
}


def register_loss(
    name: str,
    params: type[Params],
    build: Build,
    prefix: str = "",
    objective: type[Objective] = Objective,
) -> None:
    """Add a train loss from your own module (docs/contributing.md): `loss=<name>` then trains
    with it, `loss.<param>=` sets its parameters (leaves `loss.<name>.<param>`, `-` as `_`;
    config.json records them as `<prefix>_<param>`, prefix: the name, `-` as `_`), and
    `objective` is the class `build` returns (its `needs_mixed`: it reads mixed/'s images, the
    batch's `x_syn` and `t_syn`; its `mixes_rows`: see Objective).
    Register when your module is imported, which SEMIX_PLUGINS does before any config is built
    (pipeline/plugins.py)."""
    if name in OBJECTIVES:
        raise ValueError(f"loss {name!r} is registered already")
    prefix = prefix or name.replace("-", "_")
    OBJECTIVES[name] = LossEntry(params, build, prefix, objective=objective)


def build_objective(
    name: str,
    num_classes: int,
    generator: torch.Generator | None = None,
    num_samples: int = 0,
    **params: Any,
) -> Objective:
    """The objective of loss `name`, its parameters checked (unknown ones refused)."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown loss {name!r}; valid: {', '.join(OBJECTIVES)}")
    entry = OBJECTIVES[name]
    return entry.build(
        entry.params.build(f"loss {name!r}", **params), num_classes, generator, num_samples
    )


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
