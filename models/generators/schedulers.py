"""The scheduler factory: the deterministic samplers (DDIM η=0, DPM-Solver++ and UniPC
multistep) the diffusers backends build by name from a (training) scheduler config
(``SAMPLERS``, ``make_scheduler``); the generator interface is in base.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

# diffusers is imported where a scheduler is built, not here: this module is on the path of every
# config check and error message, and importing diffusers costs seconds (see registry.py)


def _ddim(config: Any) -> SchedulerMixin:
    from diffusers import DDIMScheduler

    # η is a step() argument; we never pass it, so DDIM runs with its default η = 0 (deterministic).
    return DDIMScheduler.from_config(config)


def _x0_threshold(config: Any, sampler: str) -> dict[str, Any]:
    """The multistep solvers' stand-in for DDIM's clip_sample: thresholding with a ceiling of 1
    clamps x0 to exactly [-1, 1] (the scale max(quantile, 1) is capped at sample_max_value = 1,
    then x0 is clamped to ±scale and divided by it); other ranges it would rescale, not clip. A
    2,500-step fashion-28 UNet drew its class 11 % of the time unclipped, 33 % clipped."""
    if not config.get("clip_sample", False):
        return {}
    clip_range = float(config.get("clip_sample_range", 1.0))
    if clip_range != 1.0:
        raise ValueError(
            f"{sampler} can clip x0 only to [-1, 1], this scheduler config clips to "
            f"[-{clip_range:g}, {clip_range:g}]: use sampler=ddim"
        )
    return {"thresholding": True, "sample_max_value": 1.0}


def _dpmsolver_pp(config: Any) -> SchedulerMixin:
    from diffusers import DPMSolverMultistepScheduler

    # Force the ODE variant: a saved config may name an SDE one, which draws fresh noise each step.
    # DPM-Solver has no clip_sample: _x0_threshold clips where the config does.
    clip = _x0_threshold(config, "dpmsolver++")
    return DPMSolverMultistepScheduler.from_config(config, algorithm_type="dpmsolver++", **clip)


def _unipc(config: Any) -> SchedulerMixin:
    from diffusers import UniPCMultistepScheduler

    # UniPC (Zhao et al. 2023) is an ODE solver: no step draws noise. Its settings pinned, not
    # read from the saved config (which never names them): the data-prediction form (predict_x0)
    # with the B(h) = e^h − 1 variant (bh2) and a lower-order last step, diffusers' defaults and
    # the paper's choice for few-step guided sampling; the corrector runs at every step.
    clip = _x0_threshold(config, "unipc")
    fixed = dict(predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[])
    return UniPCMultistepScheduler.from_config(config, **fixed, **clip)


# Deterministic samplers only: ancestral/SDE samplers inject new noise at every step, which breaks
# the shared-noise property of a series (docs/methods.md §1).
SAMPLERS: dict[str, Callable[[Any], SchedulerMixin]] = {
    "ddim": _ddim,
    "dpmsolver++": _dpmsolver_pp,
    "unipc": _unipc,
}


def make_scheduler(sampler: str, config: Any) -> SchedulerMixin:
    """Build the deterministic sampler ``sampler`` from a (training) scheduler config.

    A config in memory lists the fields its scheduler left at their defaults
    (``_use_default_values``), and diffusers' from_config drops those, overrides included: a
    live fit's ``clip_sample=False`` would be ignored. Dropping the list builds the sampler from
    the values the config holds, as from a scheduler_config.json (which never has the list)."""
    config = {k: v for k, v in dict(config).items() if k != "_use_default_values"}
    if sampler not in SAMPLERS:
        raise ValueError(
            f"unknown or non-deterministic sampler {sampler!r}; choose one of {sorted(SAMPLERS)} "
            "(ancestral/SDE samplers break the shared noise of a series)"
        )
    return SAMPLERS[sampler](config)
