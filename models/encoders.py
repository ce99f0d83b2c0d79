"""Image encoders for CSM re-annotation (METHODS §2): uint8 images in, unnormalised features out.

One interface, three backends:
- `OpenCLIPEncoder`: an OpenCLIP model name + a pretrained tag or a local checkpoint file
  (reference: ViT-B-32 / openai). Tags are resolved to a local file first, so tags and user files
  load through the very same `open_clip.create_model_and_transforms(name, pretrained=<file>)` call.
- `HFCLIPEncoder`: a transformers `CLIPModel` id or `save_pretrained` folder.
- `ModuleFeatureEncoder`: any module with `forward_features(x) -> [B, d]` (a semix classifier),
  the encoder for `digits`, where CLIP means nothing.

Each encoder applies its own preprocessing on the batch in torch (no PIL round trip): uint8 ->
[0, 1] -> resize (antialiased, clamped like PIL's uint8 output) -> normalise. The features are
returned unnormalised because the prototypes of METHODS §2 are means of unnormalised features.
`identity` is a JSON-able dict that pins everything the features depend on (weights and
preprocessing); the annotate stage compares it to decide whether saved prototypes are still valid.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INTERPOLATIONS = ("bicubic", "bilinear")  # torch modes that support antialias=True
PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # codes used in HF preprocessor configs
CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def file_sha256(path: str | Path) -> str:
    """Digest of a weights file: the identity of weights that have no tag."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _resize(x: Tensor, size: tuple[int, int], mode: str) -> Tensor:
    if tuple(x.shape[-2:]) == size:
        return x
    # antialias=True makes downsizing match PIL; its bicubic kernel is PIL's (a = -0.5) too.
    # The clamp mimics PIL, which resamples uint8 and therefore saturates at 0 and 255.
    return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=True).clamp_(0, 1)


def _center_crop(x: Tensor, size: tuple[int, int]) -> Tensor:
    h, w = x.shape[-2:]
    top, left = round((h - size[0]) / 2.0), round((w - size[1]) / 2.0)  # as torchvision
    return x[..., top : top + size[0], left : left + size[1]]


def _resize_shortest(x: Tensor, size: tuple[int, int], mode: str) -> Tensor:
    """CLIP's default: scale so that the image covers `size` (shortest edge), then center crop."""
    h, w = x.shape[-2:]
    scale = max(size[0] / h, size[1] / w)
    x = _resize(x, (max(size[0], int(h * scale)), max(size[1], int(w * scale))), mode)
    return _center_crop(x, size)


RESIZE_MODES = {"shortest": _resize_shortest, "squash": _resize}


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
            f"one of: {sorted(k for k, c in ENCODERS.items() if c.has_text)}"
        )


def _resolve_openclip_weights(
    model_name: str, pretrained: str, cache_dir: str | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """pretrained tag or file -> (local checkpoint file, the tag's settings, identity part)."""
    import open_clip

    tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if tag_cfg:
        try:
            return (
                open_clip.download_pretrained(tag_cfg, cache_dir=cache_dir),
                tag_cfg,
                {"pretrained": pretrained},
            )
        except (OSError, RuntimeError) as e:  # offline / hub or url failure
            raise ValueError(
                f"OpenCLIP weights {model_name}/{pretrained} are not cached and cannot be "
                f"downloaded ({type(e).__name__}); encoder_pretrained=/path/to/checkpoint "
                f"takes a local file"
            ) from e
    path = Path(pretrained).expanduser()
    if not path.is_file():
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise ValueError(
            f"OpenCLIP pretrained '{pretrained}' is neither a tag of {model_name} ({tags}) nor an "
            f"existing file; encoder_pretrained=/path/to/checkpoint takes a local file"
        )
    if path.suffix not in CHECKPOINT_SUFFIXES:
        raise ValueError(f"checkpoint {path.name}: suffix must be one of {CHECKPOINT_SUFFIXES}")
    if path.suffix == ".safetensors":
        check_safetensors(path)
    return str(path), {}, {"checkpoint_sha256": file_sha256(path)}


def check_safetensors(path: Path) -> None:
    """Read the header only: a file that is no safetensors (say, a pickle renamed) is refused in
    one line naming it, before open_clip's loader reports a bare "header too large"."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{path} is not a valid safetensors file ({str(e).strip()[:80]}); "
            "point encoder_pretrained= to a real checkpoint (a .pt/.bin pickle keeps its suffix)"
        ) from e


class OpenCLIPEncoder(ImageEncoder):
    """OpenCLIP `model_name` + `pretrained` (a tag such as 'openai', or a checkpoint file).

    Checkpoint files: .safetensors is preferred; .pt/.pth/.bin are read by open_clip with
    torch.load(weights_only=True), so no pickled code runs (TorchScript archives are refused).
    A file carries no QuickGELU flag: for OpenAI-style weights pick the '-quickgelu' model name.
    `pretrained=None` builds random weights from `init_seed` (benchmarks only).
    Offline with `HF_HUB_OFFLINE=1`, a missing tag fails at once instead of after retries.
    """

    has_text = True

    def __init__(
        self,
        model_name: str = "ViT-B-32",
        pretrained: str | None = "openai",
        *,
        cache_dir: str | None = None,
        init_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        import open_clip

        if ":" in model_name:  # 'hf-hub:' / 'local-dir:' would bypass the tag-or-file contract
            raise ValueError(
                f"OpenCLIP model '{model_name}': use a built-in name (e.g. ViT-B-32) and "
                f"encoder_pretrained=/path/to/checkpoint for local weights"
            )
        model_cfg = open_clip.get_model_config(model_name)
        if model_cfg is None:
            raise ValueError(
                f"unknown OpenCLIP model '{model_name}'; open_clip.list_models() has the valid names"
            )
        if pretrained:
            checkpoint, tag_cfg, weights_id = _resolve_openclip_weights(
                model_name, pretrained, cache_dir
            )
        else:
            checkpoint, tag_cfg, weights_id = None, {}, {"pretrained": None, "init_seed": init_seed}
        # init draws from the global RNG: seed it (random-weight identity) without disturbing it
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model, _, _ = open_clip.create_model_and_transforms(
                model_name,
                pretrained=checkpoint,
                force_quick_gelu=bool(tag_cfg.get("quick_gelu", False)),
                image_mean=tag_cfg.get("mean"),
                image_std=tag_cfg.get("std"),
                image_interpolation=tag_cfg.get("interpolation"),
                image_resize_mode=tag_cfg.get("resize_mode"),
                weights_only=True,
            )
        pp = model.visual.preprocess_cfg
        super().__init__(
            image_size=pp["size"],
            mean=pp["mean"],
            std=pp["std"],
            interpolation=pp["interpolation"],
            resize_mode=pp["resize_mode"],
            **kwargs,
        )
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.model_name = model_name
        self._feature_dim = int(model_cfg["embed_dim"])
        self._tokenizer = None
        self.identity = {"kind": "openclip", "name": model_name, **weights_id}
        self.identity.update(self.preprocessing())

    @property
    def feature_dim(self) -> int:
        return self._feature_dim

    def _forward(self, x: Tensor) -> Tensor:
        return self.model.encode_image(x, normalize=False)

    def encode_text(self, prompts: Sequence[str]) -> Tensor:
        import open_clip

        if self._tokenizer is None:
            self._tokenizer = open_clip.get_tokenizer(self.model_name)
        tokens = self._tokenizer(list(prompts)).to(self.device)
        with torch.inference_mode(), self._autocast():
            return self.model.encode_text(tokens, normalize=False).float().cpu()


def _pooled(out: Any) -> Tensor:
    """transformers 4 returns the projected features; 5 returns an output whose pooler_output is."""
    return out if isinstance(out, Tensor) else out.pooler_output


class HFCLIPEncoder(ImageEncoder):
    """transformers `CLIPModel` from a Hub id or a `save_pretrained` folder, `get_image_features`.

    Mean, std, resize and crop come from the folder's preprocessor config (CLIPImageProcessor);
    a folder without one gets the OpenAI CLIP defaults at the vision tower's image size.
    Weights load via from_pretrained (safetensors first; .bin with weights_only=True).
    A Hub id offline: set HF_HUB_OFFLINE=1 to fail at once instead of after retries.
    """

    has_text = True

    def __init__(self, model_id_or_folder: str, **kwargs: Any) -> None:
        from transformers import CLIPImageProcessor, CLIPModel

        source = str(model_id_or_folder)
        try:
            model = CLIPModel.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"Hugging Face CLIP model '{source}' cannot be loaded ({type(e).__name__}); pass a "
                f"local folder written by save_pretrained"
            ) from e
        vision_size = model.config.vision_config.image_size
        try:
            proc = CLIPImageProcessor.from_pretrained(source)
        except OSError:
            proc = CLIPImageProcessor(
                size={"shortest_edge": vision_size},
                crop_size={"height": vision_size, "width": vision_size},
            )
        size, crop = proc.size, proc.crop_size
        shortest = size.get("shortest_edge")
        resize_to = shortest if shortest else (size.get("height"), size.get("width"))
        self._crop = (crop.get("height"), crop.get("width")) if proc.do_center_crop else None
        if proc.resample not in PIL_RESAMPLE:
            raise ValueError(f"resample {proc.resample}: supported {PIL_RESAMPLE}")
        super().__init__(
            image_size=resize_to,
            mean=proc.image_mean,
            std=proc.image_std,
            interpolation=PIL_RESAMPLE[proc.resample],
            resize_mode="shortest" if shortest else "squash",
            **kwargs,
        )
        if not shortest and self._crop is None:
            self._crop = self.image_size
        self.model = model.float().to(self.device).eval().requires_grad_(False)
        self.source = source
        self._tokenizer = None
        folder = Path(source)
        if folder.is_dir():
            files = sorted(p for s in CHECKPOINT_SUFFIXES for p in folder.glob(f"*{s}"))
            weights_id = {"weights_sha256": {p.name: file_sha256(p) for p in files}}
        else:
            weights_id = {"revision": getattr(model.config, "_commit_hash", None)}
        self.identity = {"kind": "hf-clip", "name": source, **weights_id}
        self.identity.update(self.preprocessing(), center_crop=list(self._crop or []))

    @property
    def feature_dim(self) -> int:
        return int(self.model.config.projection_dim)

    def preprocess(self, images_uint8: Tensor) -> Tensor:
        x = images_uint8.permute(0, 3, 1, 2).float().div_(255.0)
        if self.resize_mode == "shortest":  # HF: shortest edge to `size`, long edge truncated
            h, w = x.shape[-2:]
            s = self.image_size[0]
            size = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)
            x = _resize(x, size, self.interpolation)
        else:
            x = _resize(x, self.image_size, self.interpolation)
        if self._crop is not None:
            x = _center_crop(x, self._crop)
        return (x - self._mean) / self._std

    def _forward(self, x: Tensor) -> Tensor:
        return _pooled(self.model.get_image_features(pixel_values=x))

    def encode_text(self, prompts: Sequence[str]) -> Tensor:
        from transformers import AutoTokenizer

        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.source)
        max_len = self.model.config.text_config.max_position_embeddings
        batch = self._tokenizer(
            list(prompts), padding=True, truncation=True, max_length=max_len, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode(), self._autocast():
            out = self.model.get_text_features(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            )
        return _pooled(out).float().cpu()


class ModuleFeatureEncoder(ImageEncoder):
    """Any module with `forward_features(x) -> [B, d]` (pooled pre-classifier features).

    Images become float in [0, 1], are resized (squash) to `image_size` only if they differ, and
    are normalised with the classifier's own `mean`/`std`. A classifier with `in_channels == 1`
    (grey digits) gets the channel mean of the RGB image and 1-channel mean/std. `identity` comes from the caller (e.g.
    the train run's config digest and weights sha256); the preprocessing is added to it.
    The module is moved to the device and put in eval mode (BatchNorm uses running statistics).
    """

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
        self.identity = {"kind": "module", **identity, **self.preprocessing()}
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
        return (_resize(x, self.image_size, self.interpolation) - self._mean) / self._std

    def _forward(self, x: Tensor) -> Tensor:
        f = self.module.forward_features(x)
        if f.ndim != 2:
            raise ValueError(f"forward_features must return [B, d], got {tuple(f.shape)}")
        self._feature_dim = f.shape[1]
        return f


ENCODERS: dict[str, type[ImageEncoder]] = {
    "openclip": OpenCLIPEncoder,
    "hf-clip": HFCLIPEncoder,
    "module": ModuleFeatureEncoder,
}


def build_encoder(kind: str, **kwargs: Any) -> ImageEncoder:
    if kind not in ENCODERS:
        raise ValueError(f"unknown encoder '{kind}'; valid: {sorted(ENCODERS)}")
    return ENCODERS[kind](**kwargs)
