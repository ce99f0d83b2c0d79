"""The machine a timing was measured on, in one small record: what a study's host.json keeps
beside its seconds and a study's rates file carries beside its rates, so that an estimate can
say when its rates are another CPU's, and what bench/RESULTS.md's "Machine:" lines name.

What moves a CPU timing here, and so what the record holds: the CPU (its model name and family:
a cloud VM's model name can be only "AMD EPYC" on two generations, family 25 and 26, so the
name alone does not tell them apart), whether it computes bf16 natively (the `avx512_bf16` and
`amx_bf16` flags: where it does, precision=auto trains in bf16, 1.3-1.4x a step; where it does
not, fp32; core/precision.py), its cores and torch's version.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX"}  # cpuinfo's flag -> its name


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key: value` fields of a /proc/cpuinfo text (every processor
    repeats them); {} for an empty text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def this_machine(cpuinfo: str | None = None) -> dict[str, Any]:
    """This machine's record: `cpu` (the model name), `cpu_family` (an int, None where unknown),
    `bf16_flags` (those of BF16_FLAGS it has), `native_bf16`, `cpu_count` and `torch`. From
    /proc/cpuinfo (`cpuinfo`: such a text instead, for tests); where the system has none (not
    Linux), the CPU is platform's name, its family None and native bf16 torch's own check
    (core.precision.native_bf16, the one precision=auto asks)."""
    import torch  # a study or a bench has it loaded already; nothing at this module's import

    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields = cpuinfo_fields(cpuinfo)
    if fields:
        flags = set(fields.get("flags", "").split())
        bf16 = [f for f in BF16_FLAGS if f in flags]
        native = bool(bf16)
    else:
        from core.precision import native_bf16

        bf16, native = [], native_bf16(torch.device("cpu"))
    family = fields.get("cpu family", "")
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_family": int(family) if family.isdigit() else None,
        "bf16_flags": bf16,
        "native_bf16": native,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


def describe(machine: Mapping[str, Any]) -> str:
    """A record in words: `AMD EPYC family 26 with AVX512-BF16, 2 cores`."""
    words = str(machine.get("cpu") or "an unnamed CPU")
    if machine.get("cpu_family") is not None:
        words += f" family {machine['cpu_family']}"
    names = [BF16_FLAGS.get(f, f) for f in machine.get("bf16_flags", [])]
    if names:
        words += f" with {' and '.join(names)}"
    elif machine.get("native_bf16"):
        words += " with native bf16"
    else:
        words += " without AVX512-BF16 or AMX (fp32)"
    if machine.get("cpu_count"):
        words += f", {machine['cpu_count']} cores"
    return words


def same_cpu(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two records are the same CPU for a timing: the same model name and family and
    the same bf16 capability (cores and torch's version aside: a study's simulation has the
    cores; torch's version is named, not compared)."""
    return (
        a.get("cpu") == b.get("cpu")
        and a.get("cpu_family") == b.get("cpu_family")
        and bool(a.get("native_bf16")) == bool(b.get("native_bf16"))
    )
