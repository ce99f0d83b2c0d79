"""Image encoders for CSM re-annotation (docs/methods.md §2): uint8 images in, unnormalised features out.

One interface (`base.ImageEncoder`), three kinds, one registry (`ENCODERS`, kind -> class):
- `openclip`: an OpenCLIP model name + a pretrained tag or a local checkpoint file
  (reference: ViT-B-32 / openai);
- `hf-clip`: a transformers `CLIPModel` id or `save_pretrained` folder;
- `module`: any module with `forward_features(x) -> [B, d]` (a semix classifier), the encoder
  for `digits`, where CLIP means nothing.

enc = build_encoder("openclip", model_name="ViT-B-32", pretrained="openai", device="cuda")
features = enc.encode(images_uint8)  # [N, d] float32, each image encoded once
"""

from __future__ import annotations

from typing import Any

from .base import PRECISIONS, ImageEncoder, default_device
from .clip import CHECKPOINT_SUFFIXES, HFCLIPEncoder, OpenCLIPEncoder, check_safetensors
from .module import ModuleFeatureEncoder

ENCODERS: dict[str, type[ImageEncoder]] = {
    cls.kind: cls for cls in (OpenCLIPEncoder, HFCLIPEncoder, ModuleFeatureEncoder)
}


def build_encoder(kind: str, **kwargs: Any) -> ImageEncoder:
    if kind not in ENCODERS:
        raise ValueError(f"unknown encoder '{kind}'; valid: {sorted(ENCODERS)}")
    return ENCODERS[kind](**kwargs)


__all__ = [
    "CHECKPOINT_SUFFIXES",
    "ENCODERS",
    "PRECISIONS",
    "HFCLIPEncoder",
    "ImageEncoder",
    "ModuleFeatureEncoder",
    "OpenCLIPEncoder",
    "build_encoder",
    "check_safetensors",
    "default_device",
]
