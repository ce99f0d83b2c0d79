"""convert-edm: an EDM network pickle -> runs/<classes>/edm/ (safetensors + config.json), once.

    python -m pipeline convert-edm --preset cifar10 --set source=edm-cifar10-32x32-cond-vp.pkl
    python -m pipeline generate --preset cifar10 --set backend=edm

The published EDM checkpoints are pickles that embed their network's source code; the restricted
reader (models/generators/edm_pickle.py) takes only the init kwargs and the weights out of it and
refuses anything else. The folder is written beside its destination and renamed into place, so
it exists only complete; an existing destination is left alone (nothing to do).
"""

from __future__ import annotations

from pathlib import Path

from core.config import ConfigError
from core.io import writing
from core.logs import log
from models.generators import EDMNetwork, convert_edm_pickle
from stages.configs.convert_edm import Config


def run(cfg: Config) -> Path:
    # 1. Inputs
    if not cfg.source:
        raise ConfigError("convert-edm needs source=<EDM network .pkl>")
    src = Path(cfg.source)
    if not src.is_file():
        raise FileNotFoundError(f"EDM network pickle {src} not found")
    dest = Path(cfg.dest) if cfg.dest else cfg.root / "edm"
    # 2. A complete destination is never rewritten
    if (dest / EDMNetwork.config_name).is_file():
        log.info("convert-edm: %s exists; nothing to do (remove it to convert again)", dest)
        return dest
    # 3. Read (restricted), rebuild, write safetensors + config
    dest.parent.mkdir(parents=True, exist_ok=True)
    with writing(dest):  # a full disk or read-only media: one line naming the folder
        convert_edm_pickle(src, dest)
    log.info("convert-edm: %s -> %s", src, dest)
    return dest
