"""Run the benchmarks and write bench/RESULTS.md.

    python -m bench                 # every bench/bench_*.py
    python -m bench shards train    # only these
    python -m bench plan            # plan, manifest, series index at 10 / 100 / 1,000 classes
    python -m bench study-task      # bench/bench_study_task.py (a hyphen names the module's _)

Each module defines `run() -> dict` with `title`, `rows` (list of dicts, one table row
each), optional `tables` ({caption: rows}, after the first), optional `notes` (list of str); or None when it has nothing to measure on this checkout
(it says why; its old section stays). Timings are measured here, never asserted in tests.
"""

from __future__ import annotations

import importlib
import platform
import sys
import time

from bench import BENCH, RESULTS
from core.machine import describe, this_machine


def machine() -> str:
    """The "Machine:" line's words: the CPU as core.machine records it (model name, family,
    bf16 capability, cores: what a study's host.json keeps too), the GPU, torch and Python."""
    import torch

    here = this_machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{describe(here)}, {gpu}, torch {here['torch']}, Python {platform.python_version()}"


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    names = argv or sorted(p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py"))
    results_path = RESULTS
    sections = {}
    if results_path.is_file():  # keep sections of benchmarks not rerun this time
        text = results_path.read_text()
        for block in text.split("\n## ")[1:]:
            sections[block.split("\n", 1)[0].strip()] = "## " + block.rstrip() + "\n"
    for name in names:
        module = importlib.import_module(f"bench.bench_{name.replace('-', '_')}")
        print(f"bench {name} ...", flush=True)
        t0 = time.perf_counter()
        result = module.run()
        took = time.perf_counter() - t0
        if result is None:  # nothing to measure here (the module said why): keep its section
            continue
        body = [
            f"## {result['title']}",
            "",
            f"Machine: {machine()}  ",
            f"Command: `python -m bench {name}` ({took:.0f} s)",
            "",
        ]
        body.append(table(result["rows"]))
        for caption, rows in result.get("tables", {}).items():  # optional further tables
            body += [f"{caption}:", "", table(rows)]
        body += [f"- {n}" for n in result.get("notes", [])]
        sections[result["title"]] = "\n".join(body).rstrip() + "\n"
        print(sections[result["title"]], flush=True)
    header = "# Benchmark results\n\nWritten by `make bench` (`python -m bench`); numbers from the machine named in each section.\n\n"
    results_path.write_text(header + "\n".join(sections[k] for k in sorted(sections)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
