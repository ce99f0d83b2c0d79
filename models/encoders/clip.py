"""CLIP image encoders: OpenCLIP (the docs/methods.md §2 reference, ViT-B-32 / openai) and transformers'
`CLIPModel`. Both also encode text, for zero-shot text prototypes.

OpenCLIP tags are resolved to a local file first, so tags and user files load through the very
same `open_clip.create_model_and_transforms(name, pretrained=<file>)` call. Local weights are
named by their sha256 in `identity`, never by where they live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.hub import hub_offline
from core.io import sha256_file
from core.parts import Params, param

from .base import ImageEncoder, center_crop, resize

PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # codes used in HF preprocessor configs
CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def _resolve_openclip_weights(
    model_name: str, pretrained: str, cache_dir: str | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """pretrained tag or file -> (local checkpoint file, the tag's settings, identity part)."""
    import open_clip

    tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if tag_cfg:
        # offline (HF_HUB_OFFLINE=1, or no answer from the Hub: hub_offline switches the hub
        # client to offline mode) a tag that is not cached fails at once, without retries
        offline = hub_offline()
        try:
            return (
                open_clip.download_pretrained(tag_cfg, cache_dir=cache_dir),
                tag_cfg,
                {"pretrained": pretrained},
            )
        except (OSError, RuntimeError, ValueError) as e:  # offline / hub or url failure
            why = "the Hub is offline" if offline else f"cannot be downloaded ({type(e).__name__})"
            raise ValueError(
                f"OpenCLIP weights {model_name}/{pretrained} are not cached and {why}; "
                f"encoder.pretrained=/path/to/checkpoint takes a local file"
            ) from e
    path = Path(pretrained).expanduser()
    if not path.is_file():
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise ValueError(
            f"OpenCLIP pretrained '{pretrained}' is neither a tag of {model_name} ({tags}) nor an "
            f"existing file; encoder.pretrained=/path/to/checkpoint takes a local file"
        )
    if path.suffix not in CHECKPOINT_SUFFIXES:
        raise ValueError(f"checkpoint {path.name}: suffix must be one of {CHECKPOINT_SUFFIXES}")
    if path.suffix == ".safetensors":
        check_safetensors(path)
    return str(path), {}, {"checkpoint_sha256": sha256_file(path)}


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
            "point encoder.pretrained= to a real checkpoint (a .pt/.bin pickle keeps its suffix)"
        ) from e


# one annotate leaf, encoder.openclip.model (config.json: encoder_model), names the model of both
# CLIP kinds
MODEL_DOC = "OpenCLIP model name, or a HF CLIP id / save_pretrained folder"


class OpenCLIPEncoder(ImageEncoder):
    """OpenCLIP `model_name` + `pretrained` (a tag such as 'openai', or a checkpoint file).

    Checkpoint files: .safetensors is preferred; .pt/.pth/.bin are read by open_clip with
    torch.load(weights_only=True), so no pickled code runs (TorchScript archives are refused).
    A file carries no QuickGELU flag: for OpenAI-style weights pick the '-quickgelu' model name.
    `pretrained=None` builds random weights from `init_seed` (benchmarks only).
    Offline (`HF_HUB_OFFLINE=1`, or no answer from the Hub) a tag that is not cached fails at
    once, in one line, instead of after retries.
    """

    kind = "openclip"
    has_text = True

    @dataclass(frozen=True)
    class Params(Params):
        """Its parameters as leaves of annotate's encoder section, `encoder.openclip.<param>`,
        recorded in config.json under the names given here since the first mixed/:
        `encoder_model`, `encoder_pretrained`, `encoder_cache`."""

        model: str = param("ViT-B-32", field="encoder_model", doc=MODEL_DOC)
        pretrained: str = param(
            "openai", field="encoder_pretrained", doc="OpenCLIP tag or a local checkpoint file"
        )
        cache: str = param(
            "", field="encoder_cache", doc='OpenCLIP download cache folder ("": open_clip\'s)'
        )

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
                f"encoder.pretrained=/path/to/checkpoint for local weights"
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
        self.identity = {"kind": self.kind, "name": model_name, **weights_id}
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
    A Hub id offline (`HF_HUB_OFFLINE=1`, or no answer from the Hub) is read from the local
    cache only: one that is not cached fails at once, in one line.
    """

    kind = "hf-clip"
    has_text = True

    @dataclass(frozen=True)
    class Params(Params):
        """Its parameter: openclip's model leaf, `encoder.openclip.model` (`encoder_model`)."""

        model: str = param("ViT-B-32", field="encoder_model", doc=MODEL_DOC)

    def __init__(self, model_id_or_folder: str, **kwargs: Any) -> None:
        from transformers import CLIPImageProcessor, CLIPModel

        source = str(model_id_or_folder)
        # a Hub id offline (HF_HUB_OFFLINE=1, or no answer from the Hub): the local cache only,
        # so an id that is not cached fails at once, without timeouts or retries
        local = {"local_files_only": True} if not Path(source).is_dir() and hub_offline() else {}
        try:
            model = CLIPModel.from_pretrained(source, **local)
        except (OSError, ValueError) as e:
            why = "not in the local cache and the Hub is offline" if local else type(e).__name__
            raise ValueError(
                f"Hugging Face CLIP model '{source}' cannot be loaded ({why}); set "
                "encoder.model=<a local folder written by save_pretrained>"
            ) from e
        vision_size = model.config.vision_config.image_size
        try:
            proc = CLIPImageProcessor.from_pretrained(source, **local)
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
        self._local = local  # the tokenizer, when text prototypes ask for it, the same way
        self._tokenizer = None
        folder = Path(source)
        if folder.is_dir():  # a local folder: named by its last part, pinned by its weights
            files = sorted(p for s in CHECKPOINT_SUFFIXES for p in folder.glob(f"*{s}"))
            name = folder.name
            weights_id = {"weights_sha256": {p.name: sha256_file(p) for p in files}}
        else:
            name = source
            weights_id = {"revision": getattr(model.config, "_commit_hash", None)}
        self.identity = {"kind": self.kind, "name": name, **weights_id}
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
            x = resize(x, size, self.interpolation)
        else:
            x = resize(x, self.image_size, self.interpolation)
        if self._crop is not None:
            x = center_crop(x, self._crop)
        return (x - self._mean) / self._std

    def _forward(self, x: Tensor) -> Tensor:
        return _pooled(self.model.get_image_features(pixel_values=x))

    def encode_text(self, prompts: Sequence[str]) -> Tensor:
        from transformers import AutoTokenizer

        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.source, **self._local)
        max_len = self.model.config.text_config.max_position_embeddings
        batch = self._tokenizer(
            list(prompts), padding=True, truncation=True, max_length=max_len, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode(), self._autocast():
            out = self.model.get_text_features(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            )
        return _pooled(out).float().cpu()
