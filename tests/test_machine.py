"""core/machine.py: the record of the machine a timing was measured on (what a study's host.json
keeps and a rates file names), from constructed /proc/cpuinfo texts: the two AMD EPYCs whose
model names are the same and whose timings are not (family 25 without bf16, family 26 with)."""

import json
import os

import torch

from core.machine import cpuinfo_fields, describe, same_cpu, this_machine


def _cpuinfo(family: int, flags: str, processors: int = 2) -> str:
    """A /proc/cpuinfo text of `processors` identical blocks, as Linux writes it."""
    block = (
        "processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 1\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu sse avx2 {flags}\n"
    )
    return "\n".join(block.format(i=i, family=family, flags=flags) for i in range(processors))


def test_the_record_names_model_family_bf16_cores_and_torch():
    zen3 = this_machine(_cpuinfo(25, "avx512f"))
    assert zen3 == {
        "cpu": "AMD EPYC",
        "cpu_family": 25,
        "bf16_flags": [],
        "native_bf16": False,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    zen5 = this_machine(_cpuinfo(26, "avx512f avx512_bf16"))
    assert zen5["bf16_flags"] == ["avx512_bf16"] and zen5["native_bf16"]
    assert this_machine(_cpuinfo(6, "amx_bf16 avx512_bf16"))["bf16_flags"] == [
        "avx512_bf16",
        "amx_bf16",
    ]
    # the first processor's fields; a later block that differs is not read
    later = _cpuinfo(25, "x") + "\n\nprocessor\t: 9\ncpu family\t: 99\n"
    assert cpuinfo_fields(later)["cpu family"] == "25"
    json.dumps(zen5)  # a record goes into host.json and the rates file as it is


def test_in_words_and_what_counts_as_another_cpu():
    zen3, zen5 = this_machine(_cpuinfo(25, "")), this_machine(_cpuinfo(26, "avx512_bf16"))
    cores = os.cpu_count()
    assert describe(zen5) == f"AMD EPYC family 26 with AVX512-BF16, {cores} cores"
    assert describe(zen3) == f"AMD EPYC family 25 without AVX512-BF16 or AMX (fp32), {cores} cores"
    # the same model name, another family: another CPU; bf16 alone differing: another CPU
    assert not same_cpu(zen3, zen5)
    assert not same_cpu(zen3, zen3 | {"native_bf16": True, "bf16_flags": ["avx512_bf16"]})
    # cores and torch's version are named, not compared (the simulation has the cores)
    assert same_cpu(zen3, zen3 | {"cpu_count": 64, "torch": "2.99.0"})
    assert not same_cpu(zen3, zen3 | {"cpu": "Intel(R) Xeon(R) Processor"})


def test_a_sitting_records_the_machine_beside_its_seconds(tmp_path):
    """host.json keeps its keys and adds the machine its seconds are (what `fit` copies)."""
    from pipeline.study.execute import Sitting

    path = tmp_path / "host.json"
    Sitting(path).write({"prepare": 11.0})
    host = json.loads(path.read_text())
    assert host["machine"] == this_machine()
    assert host["cpu_count"] == os.cpu_count() and host["task_seconds_this_invocation"] == {
        "prepare": 11.0
    }
