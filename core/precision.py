"""One precision vocabulary and one resolver for every stage.

Every precision field takes the same words, `auto | fp32 | bf16 | fp16`; `ALIASES` maps the
other spellings a config.json may hold (`no`, `""`, `float32 | bfloat16 | float16`) to them, so
those files keep their bytes (docs/compat.md). `resolve_precision` says once what `auto` is:

- on a GPU: bf16 where the GPU computes it, else fp32 (never fp16 silently);
- on a CPU: fp32, unless the stage measured that bf16 pays there (`cpu_bf16=True`), and then only
  on a CPU that computes bf16 natively (AVX512-BF16 or AMX): fit-generator's step (1.3x) and the
  classifier loop's train step (1.4x; bench/RESULTS.md). The samplers and the encoders keep fp32
  on CPUs, and so do the classifier's logits wherever they are measured (validation, evaluate);
- under `accelerate launch`, accelerate's own mixed precision wins over `auto`, and a stage value
  that names another one is refused in one line (`launcher_precision`).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from core.config import ConfigError, did_you_mean

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# the other spellings a config.json may hold, and the word each means
ALIASES = {"": "auto", "no": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
ACCELERATE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}  # accelerate's mixed_precision words
FROM_ACCELERATE: dict[str, Precision] = {v: k for k, v in ACCELERATE.items()}  # type: ignore[misc]
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the generators' words


def canonical(value: str) -> str:
    """`value` in the one vocabulary (an alias mapped to its word)."""
    return ALIASES.get(value, value)


def check_precision(field: str, value: str, allowed: tuple[str, ...] = PRECISIONS) -> None:
    """Refuse, in one line, a value outside the vocabulary or outside the stage's `allowed`
    words (the classifier loop has no fp16: its gradients would need a scaler)."""
    word = canonical(value)
    if word in allowed:
        return
    if word in PRECISIONS:
        raise ConfigError(f"{field}={value!r} is not one of this stage's: {', '.join(allowed)}")
    raise ConfigError(
        f"{field}={value!r} is not a precision; {did_you_mean(value, allowed)}"
        f"choose one of: {', '.join(allowed)}"
    )


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively (a bf16 GPU; a CPU with AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return bool(
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    )


def launcher_precision(field: str, value: str, resolved: str) -> str:
    """Mixed precision ("no", "bf16", "fp16") as accelerate's conventions want it: under
    `accelerate launch` its value (its --mixed_precision flag, else its config file, else its
    default "no": ACCELERATE_MIXED_PRECISION) wins over semix's `field` = "auto"; a semix value
    that names another precision is a conflict, refused in one line before any work. Outside
    accelerate launch, `resolved` (semix's own choice for `value`)."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "")
    if not launcher:
        return resolved
    if value == "auto":
        return launcher
    if resolved != launcher:
        raise ConfigError(
            f"{field}={value} conflicts with accelerate launch's mixed precision {launcher!r} "
            "(its --mixed_precision flag, its config file or its default): give one of them, "
            f"or leave {field}=auto to follow accelerate"
        )
    return resolved


def resolve_precision(
    field: str, value: str, device: torch.device, *, cpu_bf16: bool = False, launcher: bool = True
) -> Precision:
    """The precision a stage computes in: `value` (a word or an alias), `auto` resolved
    as the module docstring says. `launcher`: the stage runs under accelerate (its mixed precision
    is accelerate's to set); a stage that casts by itself (generate, annotate) passes False."""
    word = canonical(value)
    own = word
    if word == "auto":
        gpu = device.type == "cuda"
        own = "bf16" if (gpu or cpu_bf16) and native_bf16(device) else "fp32"
    if not launcher:
        return own  # type: ignore[return-value]
    mixed = launcher_precision(field, "auto" if word == "auto" else value, ACCELERATE[own])
    return FROM_ACCELERATE[mixed]
