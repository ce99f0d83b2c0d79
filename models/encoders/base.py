"""What every image encoder shares: uint8 images in, unnormalised features out (docs/methods.md §2).

Each encoder applies its own preprocessing on the batch in torch (no PIL round trip): uint8 ->
[0, 1] -> resize (antialiased, clamped like PIL's uint8 output) -> normalise. The features are
returned unnormalised because the prototypes of docs/methods.md §2 are means of unnormalised features.
`identity` is a JSON-able dict that pins everything the features depend on (weights and
preprocessing); the annotate stage compares it to decide whether saved prototypes are still valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INTERPOLATIONS = ("bicubic", "bilinear")  # torch modes that support antialias=True


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def resize(x: Tensor, size: tuple[int, int], mode: str) -> Tensor:
    if tuple(x.shape[-2:]) == size:
        return x
    # antialias=True makes downsizing match PIL; its bicubic kernel is PIL's (a = -0.5) too.
    # The clamp mimics PIL, which resamples uint8 and therefore saturates at 0 and 255.
    return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=True).clamp_(0, 1)


def center_crop(x: Tensor, size: tuple[int, int]) -> Tensor:
    h, w = x.shape[-2:]
    top, left = round((h - size[0]) / 2.0), round((w - size[1]) / 2.0)  # as torchvision
    return x[..., top : top + size[0], left : left + size[1]]


def _resize_shortest(x: Tensor, size: tuple[int, int], mode: str) -> Tensor:
    """CLIP's default: scale so that the image covers `size` (shortest edge), then center crop."""
    h, w = x.shape[-2:]
    scale = max(size[0] / h, size[1] / w)
    x = resize(x, (max(size[0], int(h * scale)), max(size[1], int(w * scale))), mode)
    return center_crop(x, size)


RESIZE_MODES = {"shortest": _resize_shortest, "squash": resize}


def _check_images(images: Tensor) -> Tensor:
    images = torch.as_tensor(images)
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(
            f"images must be a uint8 tensor [N, H, W, 3]; got {images.dtype} {tuple(images.shape)}"
        )
    return images


class ImageEncoder:
    """images uint8 [N, H, W, 3] -> float32 features [N, d] on the CPU, each image encoded once.

    Subclasses set the model and the preprocessing fields and implement `_forward`.
    """

    kind: str  # its name in the registry (models.encoders.ENCODERS) and in `identity`
    identity: dict[str, Any]
    device: torch.device
    has_text = False  # True where encode_text exists (zero-shot text prototypes)

    def __init__(
        self,
        *,
        image_size: int | Sequence[int],
        mean: Sequence[float],
        std: Sequence[float],
        interpolation: str = "bicubic",
        resize_mode: str = "shortest",
        device: str | torch.device | None = None,
        batch_size: int = 256,
        precision: str = "fp32",
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision '{precision}'; valid: {sorted(PRECISIONS)}")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"unknown interpolation '{interpolation}'; valid: {INTERPOLATIONS}")
        if resize_mode not in RESIZE_MODES:
            raise ValueError(f"unknown resize mode '{resize_mode}'; valid: {sorted(RESIZE_MODES)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device) if device is not None else default_device()
        self.image_size = _pair(image_size)
        self.interpolation, self.resize_mode = interpolation, resize_mode
        self.batch_size, self.precision = batch_size, precision
        if len(mean) != len(std) or len(mean) not in (1, 3):
            raise ValueError(f"mean and std need 1 or 3 channels each, got {mean} and {std}")
        self._mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)

    def preprocessing(self) -> dict[str, Any]:
        """The preprocessing part of `identity`: changing any of it changes the features."""
        return {
            "image_size": list(self.image_size),
            "mean": [float(v) for v in self._mean.flatten()],
            "std": [float(v) for v in self._std.flatten()],
            "interpolation": self.interpolation,
            "resize_mode": self.resize_mode,
        }

    @property
    def feature_dim(self) -> int:
        raise NotImplementedError

    def preprocess(self, images_uint8: Tensor) -> Tensor:
        """uint8 [B, H, W, 3] (on self.device) -> normalised float32 [B, 3, h, w]."""
        x = images_uint8.permute(0, 3, 1, 2).float().div_(255.0)
        x = RESIZE_MODES[self.resize_mode](x, self.image_size, self.interpolation)
        return (x - self._mean) / self._std

    def _forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _autocast(self):
        dtype = PRECISIONS[self.precision]
        return nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def encode(self, images_uint8: Tensor) -> Tensor:
        images = _check_images(images_uint8)
        out = []
        with torch.inference_mode():
            for start in range(0, images.shape[0], self.batch_size):
                # uint8 crosses to the device (4x less traffic than float); preprocessing is fp32.
                x = self.preprocess(images[start : start + self.batch_size].to(self.device))
                with self._autocast():
                    out.append(self._forward(x).float())
        if not out:
            return torch.empty(0, self.feature_dim)
        return torch.cat(out).cpu()  # one device->host copy, after all batches are queued

    def encode_text(self, prompts: Sequence[str]) -> Tensor:
        raise ValueError(
            f"encoder '{self.identity.get('kind')}' has no text tower; text prototypes need "
            f"one of: {text_kinds()}"
        )


def text_kinds() -> list[str]:
    """The encoder kinds with a text tower, from the subclasses themselves (the registry in
    models.encoders is built from the same classes; asking it from here would be an import
    cycle)."""
    found, todo = set(), [ImageEncoder]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "kind", "") and getattr(cls, "has_text", False):
            found.add(cls.kind)
    return sorted(found)
