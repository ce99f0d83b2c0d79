"""Pure-torch pieces of the finetune stage (docs/methods.md §4 MaC-Cal, §5 FeDLaS).

- `build_model(arch)`: rebuild a classifier from model.json's "arch", including a replaced head.
  MaC-Cal swaps the linear head for `MaskedBottleneckHead`, so its model.json carries
  `arch["head"] = {"type": "masked-bottleneck", "r": 256}`; readers that rebuild with
  `build_model` instead of `classifier_from_config` then load the fine-tuned weights as they are.
- `require_separable_head(model)`: the fine-tuning methods read the pooled feature h and the
  head separately; a model without that split is refused with one line.
- `GateTracker`: per-sample ψ of FeDLaS over epochs -> share of each gate mode, flip rate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from models.classifiers import Classifier, classifier_from_config
from models.fedlas import GATE_MODES
from models.heads import MaskedBottleneckHead

MASKED_BOTTLENECK = "masked-bottleneck"

# head type in arch["head"] -> factory(feature_dim d, num_classes C, spec) -> module
HEADS: dict[str, Callable[[int, int, Mapping[str, Any]], nn.Module]] = {
    "linear": lambda d, c, spec: nn.Linear(d, c),
    MASKED_BOTTLENECK: lambda d, c, spec: MaskedBottleneckHead(d, c, int(spec["r"])),
}


def head_spec(head: nn.Module) -> dict[str, Any]:
    """arch["head"] entry describing `head` (what `build_model` turns back into it)."""
    if isinstance(head, MaskedBottleneckHead):
        return {"type": MASKED_BOTTLENECK, "r": head.fc1.out_features}
    if isinstance(head, nn.Linear):
        return {"type": "linear"}
    raise ValueError(f"no head type for {type(head).__name__}; known: {', '.join(HEADS)}")


def arch_with_head(model: Classifier) -> dict[str, Any]:
    """`model.arch_config()` plus its head, for model.json."""
    return {**model.arch_config(), "head": head_spec(model.head)}


def build_model(arch: Mapping[str, Any]) -> Classifier:
    """`classifier_from_config(arch)` with the head named by arch["head"] (absent: linear).

    Fresh weights, like `classifier_from_config`: load the saved state dict on top.
    """
    model = classifier_from_config(dict(arch))
    spec = arch.get("head")
    if spec is None:
        return model
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if kind not in HEADS:
        raise ValueError(
            f"unknown head type {kind!r} in the arch config; valid: {', '.join(HEADS)}"
        )
    require_separable_head(model)
    model.head = HEADS[kind](model.feature_dim, model.num_classes, spec)
    return model


def require_separable_head(model: nn.Module, where: str = "the model") -> None:
    """Refuse models whose logits are not `head(forward_features(x))` with a known feature size.

    MaC-Cal trains a new head on h = forward_features(x) (size `feature_dim`), FeDLaS' NCI reads
    h; both need a `Classifier` that implements forward_features and has a `head` module.
    """
    implements = type(model).forward_features is not Classifier.forward_features
    if not (
        isinstance(model, Classifier)
        and implements
        and isinstance(getattr(model, "head", None), nn.Module)
        and not isinstance(model.head, nn.Identity)
        and isinstance(getattr(model, "feature_dim", None), int)
        and model.feature_dim > 0
    ):
        raise ValueError(
            f"{where} has no separable head (needs a Classifier with forward_features(x) -> "
            f"[B, feature_dim] and a head module); MaC-Cal and FeDLaS cannot fine-tune it"
        )


class GateTracker:
    """Per-sample gate direction ψ_i of FeDLaS (docs/methods.md §5) across training epochs.

    Each epoch records the ψ of every sample seen (from its training forward pass, under that
    step's augmentation). `end_epoch()` returns the share of the epoch's samples in each gate
    mode (order `GATE_MODES`: +1, −1, 0) and the flip rate: the share of samples seen in this
    and the previous epoch whose ψ changed (None in the first epoch: nothing to compare).
    Under several processes each sees its own samples; `end_epoch(reduce)` sums the records
    (every sample is seen by one process per epoch) so all agree. The record lives on the
    device of the ψ it gets (no host sync per step); `state_dict()` is what a resume needs.
    """

    def __init__(self, num_samples: int) -> None:
        self.prev = torch.zeros(num_samples, dtype=torch.int8)
        self.prev_seen = torch.zeros(num_samples, dtype=torch.bool)
        self.cur, self.seen = self.prev.clone(), self.prev_seen.clone()

    def update(self, idx: Tensor, psi: Tensor) -> None:
        """ψ [B] of the samples with dataset indices idx [B]."""
        if self.cur.device != psi.device:
            self.prev, self.prev_seen, self.cur, self.seen = (
                t.to(psi.device) for t in (self.prev, self.prev_seen, self.cur, self.seen)
            )
        idx = idx.to(psi.device)
        self.cur[idx] = psi.detach().sign().to(torch.int8)
        self.seen[idx] = True

    def end_epoch(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, Any]:
        if reduce is not None:  # each sample was seen by one process: the sums are the records
            both = torch.stack([self.cur.to(torch.int32), self.seen.to(torch.int32)])
            cur, seen = reduce(both)
            self.cur, self.seen = cur.to(torch.int8), seen.bool()
        if not bool(self.seen.any()):
            raise ValueError("no gate decisions recorded this epoch")
        psi = self.cur[self.seen]
        share = {m: float((psi == v).float().mean()) for m, v in zip(GATE_MODES, (1, -1, 0))}
        both = self.seen & self.prev_seen
        flip = float((self.cur[both] != self.prev[both]).float().mean()) if both.any() else None
        self.prev, self.prev_seen = self.cur.clone(), self.seen.clone()
        self.cur.zero_()
        self.seen.zero_()
        return {"mode_share": share, "flip_rate": flip}

    def state_dict(self) -> dict[str, Tensor]:
        return {"prev": self.prev, "prev_seen": self.prev_seen}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        device = self.cur.device
        self.prev, self.prev_seen = state["prev"].to(device), state["prev_seen"].to(device)
