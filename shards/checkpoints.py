"""Training checkpoints on disk: what a resume may load, checked before anything is loaded.

accelerate's `save_state` folder holds the model (safetensors), the optimizer and scheduler
(`.bin`) and the RNG states (`random_states_<rank>.pkl`); accelerate >= 1.x reads the latter
three with `torch.load(weights_only=True)` (tensors and plain containers only: no code runs),
and we pass `weights_only=True` ourselves where its API lets us. Objects registered with
`register_for_checkpointing` are another matter: accelerate unpickles their
`custom_checkpoint_<i>.pkl` in full, so semix registers none (it writes its own state as
safetensors + JSON) and refuses a checkpoint folder that holds such a file, or anything else
it does not know, rather than load it.
"""

from __future__ import annotations

import re
from pathlib import Path

from shards.manifest import ShardError

# accelerate's own files, all read with weights_only=True (or safetensors)
_ACCELERATE = (
    r"model(_\d+)?\.safetensors",
    r"(optimizer|scheduler|sampler)(_\d+)?\.bin",
    r"random_states_\d+\.pkl",
    r"scaler\.pt",
)
LOAD_KWARGS = {"weights_only": True}  # for accelerator.load_state(load_kwargs=...)


def check_checkpoint(folder: Path, marker: str, ours: tuple[str, ...] = ()) -> Path:
    """`folder` is a complete checkpoint (`marker`, written last, exists) holding only files that
    load without unpickling: accelerate's own, and `ours` (semix's safetensors / JSON files)."""
    folder = Path(folder)
    if not (folder / marker).is_file():
        raise ShardError(f"{folder} is not a complete semix checkpoint (no {marker}); use another")
    allowed = re.compile("|".join([*_ACCELERATE, *map(re.escape, (marker, *ours))]))
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not allowed.fullmatch(path.name):
            raise ShardError(
                f"{path}: not a file semix checkpoints hold (pickled state is never loaded); "
                f"remove it, or start over without this checkpoint"
            )
    return folder
