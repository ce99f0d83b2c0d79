"""Experiment tracking through accelerate's trackers: the `tracker=` field of train, finetune and
fit-generator.

    tracking = Tracking.of(cfg.tracker, run_dir, cfg.root)     # tracker=tensorboard,mlflow
    accelerator = make_accelerator(..., **tracking.accelerator_kwargs())
    tracking.start(accelerator, cfg.to_dict())                 # main process: init_trackers
    accelerator.log(scalars(stats), step=epoch)                # main process (accelerate)
    tracking.finish(accelerator)                               # before the output's manifest

What a tracker records is a view of the run, never part of it: `tracker` is no identity field
(shards.writer.NOT_IDENTITY: not in config.json, not compared), and the local files go to
`<output>/tracking/`, a subfolder, which a run's manifest never lists (it lists the output's
own files). The same run with or without a tracker writes the same output files.

Where each tracker writes: TensorBoard `<output>/tracking/tensorboard/` (event files; the
resolved config as hparams); wandb its run under `<output>/tracking/wandb/` (WANDB_DIR moves it;
WANDB_MODE=offline keeps it local) and the wandb server; mlflow its tracking URI
(MLFLOW_TRACKING_URI, else mlflow's default in the working directory); trackio its local store
(TRACKIO_DIR, else ~/.cache/huggingface/trackio). Project `semix-<classes>`, run
`<classes>/<stage folder>/<run>` (e.g. digits/train/ce).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.logs import log

# tracker -> modules of which one must be importable; each installs with `pip install <tracker>`
# (TensorBoard through torch.utils.tensorboard, which needs the tensorboard package; accelerate
# falls back to tensorboardX)
TRACKERS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "trackio": ("trackio",),
}
NONE = "none"
FOLDER = "tracking"  # <output>/tracking/: the trackers' local files, never in a manifest
# metric names every tracker takes (mlflow: letters, digits, _ - . / and space; no +, =, :)
_UNSAFE = re.compile(r"[^\w.\-/]")


def parse_trackers(value: str) -> tuple[str, ...]:
    """`tracker=` -> the tracker names, in order ("none" or "": none). An unknown name or a
    tracker whose package is not installed is a ConfigError: one line naming what to install."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names in ([], [NONE]):
        return ()
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"tracker={value!r}: {name!r} is not a tracker; give {NONE} alone, or one or more "
                f"of {', '.join(TRACKERS)} (comma-separated, e.g. tracker=tensorboard,mlflow)"
            )
    names = list(dict.fromkeys(names))
    missing = [n for n in names if not any(map(_installed, TRACKERS[n]))]
    if missing:
        raise ConfigError(
            f"tracker={value} needs {' and '.join(missing)}, not installed here: "
            f"pip install {' '.join(missing)} (or tracker={NONE})"
        )
    return tuple(names)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of `values` (an epoch's stats, a fidelity point) as tracker metrics: nested
    dicts flattened to "a/b" names, names made safe for every tracker, anything that is not a
    number (None, strings, lists) left out."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = _UNSAFE.sub("_", f"{prefix}{key}".replace("+", "plus"))  # FeDLaS' mode +1
        if isinstance(value, Mapping):
            out |= scalars(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def hparams(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """A resolved config as every tracker's hyperparameters take it: scalars as they are, lists
    as JSON text (TensorBoard's hparams refuse anything else)."""
    return {
        k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
        for k, v in config.items()
        if v is not None
    }


@dataclass(frozen=True)
class Tracking:
    """The trackers of one stage's output folder (`folder`, under the runs root `root`)."""

    trackers: tuple[str, ...]
    folder: Path
    root: Path

    @classmethod
    def of(cls, tracker: str, folder: Path, root: Path) -> Tracking:
        return cls(parse_trackers(tracker), Path(folder), Path(root))

    @property
    def local(self) -> Path:
        return self.folder / FOLDER

    @property
    def project(self) -> str:
        return f"semix-{self.root.name}"

    @property
    def run_name(self) -> str:
        return f"{self.root.name}/{self.folder.relative_to(self.root).as_posix()}"

    def accelerator_kwargs(self) -> dict[str, Any]:
        """`log_with` and `project_dir` for the Accelerator; {} without trackers. TensorBoard
        is given as accelerate's own tracker, built here, so that its event files go to
        tracking/tensorboard/ (by name, accelerate would put them under the project name)."""
        if not self.trackers:
            return {}
        from accelerate.tracking import TensorBoardTracker

        log_with = [
            TensorBoardTracker("tensorboard", str(self.local)) if t == "tensorboard" else t
            for t in self.trackers
        ]
        return {"log_with": log_with, "project_dir": str(self.local)}

    def start(self, accelerator: Any, config: Mapping[str, Any]) -> None:
        """accelerate's init_trackers with the resolved config (main process; accelerate
        starts nothing on the others). Call it once the output folder's identity is settled
        (config.json written), never for a complete output: it writes files."""
        if not self.trackers:
            return
        values = hparams(config)
        wandb: dict[str, str] = {"name": self.run_name}
        if not os.environ.get("WANDB_DIR"):
            wandb["dir"] = str(self.local)  # wandb adds its own wandb/ folder below
        init_kwargs = {
            "wandb": wandb,
            "mlflow": {"run_name": self.run_name},
            # trackio takes the config in trackio.init: accelerate's store_init_configuration
            # calls trackio.config.update(values, allow_val_change=True), wandb's signature,
            # on trackio's plain dict, which then holds a config field allow_val_change=True
            "trackio": {"name": self.run_name, "config": values},
        }  # TensorBoard: built in accelerator_kwargs
        accelerator.init_trackers(self.project, init_kwargs=init_kwargs)  # main process only
        for tracker in accelerator.trackers:  # empty on the other processes
            if tracker.name != "trackio":
                tracker.store_init_configuration(values)
        if accelerator.is_main_process:
            log.info(
                "%s: tracked with %s (project %s; local files under %s)",
                self.run_name, ", ".join(self.trackers), self.project, self.local,
            )  # fmt: skip

    def finish(self, accelerator: Any) -> None:
        """Close every tracker (main process), before the output's manifest is written. Not
        accelerator.end_training(): that also destroys the process group, which the launch
        still needs (run_launched's barrier, a chain's next stage)."""
        for tracker in accelerator.trackers:
            tracker.finish()
        accelerator.trackers.clear()
