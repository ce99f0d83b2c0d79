"""Reading a backend's weights: a local folder or a Hub id, and one clear line when it fails.

Light on purpose (no diffusers import): a Hub id the local cache lacks while the Hub is offline
is refused by ``require_cached`` with huggingface_hub alone, before a backend imports diffusers'
pipelines (seconds of imports for a one-line error).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.hub import hub_offline


class ModelNotFoundError(OSError):
    """A model id/folder that cannot be loaded (missing folder, or offline and not cached)."""


class ModelLoadError(ValueError):
    """A local model folder exists but does not load."""


@functools.cache
def _dtype_keyword() -> str:
    # diffusers 0.40 renamed from_pretrained's `torch_dtype` to `dtype` (the old name warns a
    # FutureWarning until 1.0); older versions know only `torch_dtype` and silently ignore
    # `dtype` (the weights would load in float32), so the keyword follows the installed version.
    import diffusers
    from packaging.version import Version

    return "dtype" if Version(diffusers.__version__) >= Version("0.40") else "torch_dtype"


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``{keyword: dtype}``, the precision argument of diffusers' ``from_pretrained``."""
    return {_dtype_keyword(): dtype}


def _not_found(model: str, offline: bool) -> ModelNotFoundError:
    why = (
        "not a local folder and not in the local Hugging Face cache, and the Hub is offline"
        if offline
        else "not a local folder and not loadable from the Hub (unknown id, or no access)"
    )
    return ModelNotFoundError(
        f"generator model {model!r} not found: {why}; set model=<a local save_pretrained "
        "folder> (or download it once where the Hub is reachable)"
    )


def require_cached(model: str | Path, revision: str | None = None) -> None:
    """Refuse at once (``load_pretrained``'s one line) a ``model`` that is no local folder and
    not in the local Hugging Face cache while the Hub is offline; huggingface_hub only."""
    if Path(model).is_dir() or not hub_offline():
        return
    from huggingface_hub import snapshot_download

    try:  # offline, the cache is all a loader could read: no snapshot, no model
        snapshot_download(str(model), revision=revision, local_files_only=True)
    except (OSError, ValueError) as err:  # not cached, or not even a valid repo id
        raise _not_found(str(model), offline=True) from err


def load_pretrained(load: Callable[..., Any], model: str | Path, **kwargs: Any) -> Any:
    """``load(model, **kwargs)`` (a ``from_pretrained``), turning "not found" into one clear line.

    An existing folder that fails to load (missing or truncated weights, a broken config) is
    reported in one line naming it.
    """
    from safetensors import SafetensorError

    model = str(model)  # diffusers' pipeline loader wants a str
    if Path(model).is_dir():
        try:
            return load(model, **kwargs)
        except (OSError, ValueError, SafetensorError, EOFError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise ModelLoadError(
                f"cannot load the model in {model} ({first}): the folder is incomplete or "
                "damaged; rebuild it (e.g. rerun fit-generator) or set `model` to a complete "
                "save_pretrained folder"
            ) from err
    # a Hub id: offline (HF_HUB_OFFLINE=1, or no answer from the Hub) only the local cache is
    # read, so a model that is not cached fails at once, without timeouts, retries or warnings
    offline = hub_offline()
    try:
        return load(model, **kwargs, **({"local_files_only": True} if offline else {}))
    except (OSError, ValueError) as err:
        raise _not_found(model, offline) from err


def load_pipeline(name: str, model: str | Path, revision: str | None, dtype: Any, **kwargs: Any):
    """diffusers' pipeline class `name` (``StableDiffusionPipeline``, ``DiTPipeline``) loaded
    from `model` at `revision` in `dtype`: an uncached hub id offline fails before diffusers'
    pipeline imports (seconds), any other failure in ``load_pretrained``'s one line."""
    require_cached(model, revision)
    import diffusers

    load = getattr(diffusers, name).from_pretrained
    return load_pretrained(load, model, revision=revision, **dtype_kwarg(dtype), **kwargs)
