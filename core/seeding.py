"""Seeds. Reproducibility rule: every random draw comes from an explicit generator derived from
(run seed, key), never from global RNG state, so results do not depend on call order, batch
size, rank or resume point.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def derive_seed(seed: int, *key: Any) -> int:
    """A 63-bit seed from (seed, key...): stable across runs, machines and Python versions."""
    payload = json.dumps([seed, *key], separators=(",", ":"), default=str).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") & ((1 << 63) - 1)


def make_generator(seed: int, *key: Any, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(seed, *key))
