"""Shared fixtures: small real data on disk, built once per session."""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("SEMIX_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m pipeline` subprocesses run from any cwd."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """runs/digits/ with real/{train,val,test} prepared once for the whole session.

    Read-only for tests: copy it (shutil.copytree) before writing next to it.
    """
    from pipeline.cli import run_stage

    out = tmp_path_factory.mktemp("runs")
    run_stage("prepare", "digits", [f"out={out}"])
    return out / "digits"


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (opt in with `pytestmark = pytest.mark.usefixtures(...)`):
    on a shared 2-core machine OpenMP's second thread makes tiny CPU kernels much slower, and
    CPU bytes can depend on the thread count."""
    from pipeline.runtime import cpu_threads

    with cpu_threads(1):
        yield


def tiny_openclip(
    folder: Path, name: str, *, layers: int = 1, width: int = 32, head_width: int = 16
):
    """A random-weight OpenCLIP model registered under `name` from a config file in `folder`
    (vision 32x32, tiny text tower), seeded without touching the global RNG."""
    import json

    import open_clip
    import torch

    cfg = {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "layers": layers,
            "width": width,
            "patch_size": 8,
            "head_width": head_width,
        },
        "text_cfg": {
            "context_length": 16,
            "vocab_size": 49408,
            "width": 32,
            "heads": 2,
            "layers": 1,
        },
    }
    (folder / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder / f"{name}.json")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return open_clip.create_model(name, pretrained=None).eval()


def tiny_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
    )


@pytest.fixture
def read_only(monkeypatch):
    """read_only(root): every write, rename, removal or mkdir under `root` fails with EROFS, as
    on read-only media (the tests run as root, so file modes would not stop anything)."""

    def guard(root: Path) -> None:
        root = str(root.resolve())

        def inside(path) -> bool:
            try:
                return os.path.abspath(os.fspath(path)).startswith(root)
            except TypeError:  # a file descriptor
                return False

        def refuse(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

        real_open = builtins.open

        def open_(file, mode="r", *args, **kwargs):
            if inside(file) and any(c in mode for c in "wax+"):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def wrap(fn):
            def guarded(path, *args, **kwargs):
                if inside(path):
                    refuse(path)
                return fn(path, *args, **kwargs)

            return guarded

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        for name in ("replace", "rename", "unlink", "remove", "mkdir", "rmdir"):
            monkeypatch.setattr(os, name, wrap(getattr(os, name)))

    return guard


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under root: (mtime, bytes), to show that nothing was written (or rewritten)."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
