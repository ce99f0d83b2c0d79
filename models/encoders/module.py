"""Features of any module with `forward_features(x) -> [B, d]`: the encoder for datasets where
CLIP means nothing (the digits), fed a semix classifier trained on the real images."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .base import ImageEncoder, resize


class ModuleFeatureEncoder(ImageEncoder):
    """Any module with `forward_features(x) -> [B, d]` (pooled pre-classifier features).

    Images become float in [0, 1], are resized (squash) to `image_size` only if they differ, and
    are normalised with the classifier's own `mean`/`std`. A classifier with `in_channels == 1`
    (grey digits) gets the channel mean of the RGB image and 1-channel mean/std. `identity` comes from the caller (e.g.
    the train run's config digest and weights sha256); the preprocessing is added to it.
    The module is moved to the device and put in eval mode (BatchNorm uses running statistics).
    """

    kind = "module"

    def __init__(
        self,
        module: nn.Module,
        image_size: int | Sequence[int],
        mean: Sequence[float],
        std: Sequence[float],
        identity: dict[str, Any],
        *,
        interpolation: str = "bilinear",
        **kwargs: Any,
    ) -> None:
        if not callable(getattr(module, "forward_features", None)):
            raise ValueError(f"{type(module).__name__} has no forward_features(x) -> [B, d]")
        super().__init__(
            image_size=image_size,
            mean=mean,
            std=std,
            interpolation=interpolation,
            resize_mode="squash",
            **kwargs,
        )
        self.in_channels = int(getattr(module, "in_channels", 3))
        if self._mean.shape[1] != self.in_channels:
            raise ValueError(
                f"mean/std have {self._mean.shape[1]} channels, module wants {self.in_channels}"
            )
        self.module = module.to(self.device).eval()
        dim = getattr(module, "feature_dim", None)  # semix classifiers declare it
        self._feature_dim: int | None = dim if isinstance(dim, int) else None
        self.identity = {"kind": self.kind, **identity, **self.preprocessing()}
        try:
            json.dumps(self.identity)
        except TypeError as e:
            raise ValueError(f"identity must be JSON-able: {e}") from e

    @property
    def feature_dim(self) -> int:
        if self._feature_dim is None:  # probe once with one blank image when asked before encode
            self.encode(torch.zeros(1, *self.image_size, 3, dtype=torch.uint8))
        return self._feature_dim

    def preprocess(self, images_uint8: Tensor) -> Tensor:
        x = images_uint8.permute(0, 3, 1, 2).float().div_(255.0)
        if self.in_channels == 1:
            x = x.mean(dim=1, keepdim=True)  # grey stored as RGB -> one channel
        return (resize(x, self.image_size, self.interpolation) - self._mean) / self._std

    def _forward(self, x: Tensor) -> Tensor:
        f = self.module.forward_features(x)
        if f.ndim != 2:
            raise ValueError(f"forward_features must return [B, d], got {tuple(f.shape)}")
        self._feature_dim = f.shape[1]
        return f
