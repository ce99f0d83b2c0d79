"""The accelerate `Accelerator` of a stage, in a process that may run several stages."""

from __future__ import annotations

from typing import Any


def new_accelerator(*, cpu: bool, mixed_precision: str, **kwargs: Any):
    """An ``accelerate.Accelerator`` for one stage of a process that may run several (a chain,
    the demo): accelerate keeps the mixed precision process-wide and refuses a second value, so
    a stage that wants another one resets that part of its state first (the distributed process
    group, in ``PartialState``, is kept)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and str(state.get("mixed_precision")) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(cpu=cpu, mixed_precision=mixed_precision, **kwargs)
