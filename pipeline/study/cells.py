"""The generator's sampler cell, (guidance w, DDIM's x̂₀ clipping), as one of csm's
hyper-parameters: chosen by what its data teaches a classifier on val, among the cells its
endpoints are faithful at.

fit-generator judges every cell of its grid (fidelity.guidance_grid x clipping on / off) by the
share of pure-class endpoints its chooser, the 5k encoder, takes for their class, and records
the most faithful cell as the generator's (fidelity.json). Fidelity is necessary, not what the
study wants: the cell whose in-between images teach the classifier the best doubt. So the study:

1. keeps the cells whose fidelity is at least FIDELITY_FLOOR (the fit's own cell always), at most
   MAX_CELLS of them (the fit's cell and the others spread evenly over the passing ones: each
   cell costs a full mixed set);
2. draws each kept cell's mixed set with set 0's generate seed (its own chain into
   <root>-cell-<key>/, upstream shared by link) and trains csm on it at the csm grid's
   reference point at every tuning seed (tune-cell-<key>[-t<seed>]);
3. chooses by the study's one tuning rule (pipeline.study.tuning.choose_point), the fit's cell as
   the reference: another cell wins only by more than the standard error of its paired val-NLL
   gaps.

Every csm-family mixed set is then drawn at the chosen cell: set 0 (the chain's own generate,
which waits for the choice and takes the chosen cell's set by link, the same seed and settings
making the same bytes) and every other set. fidelity.json stays fit-generator's (a stage never
writes into another's finished folder); the choice, every cell's fidelity and val scores are in
study.json's "generator".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from core.io import read_json
from pipeline.chain import scoped_errors, split_sets
from pipeline.registry import resolve_stage_config
from pipeline.study.config import METHODS, Task
from pipeline.study.mixed_sets import link_complete, share_upstream, variant_root
from pipeline.study.protocol import PROTOCOL
from pipeline.study.tuning import (
    REFERENCE,
    TUNE_SEED,
    choose_point,
    score_row,
    set_values,
    val_score,
)
from shards.manifest import is_complete
from stages.presets import chain_steps

# the endpoint fidelity (%, by the fit's chooser judge) a cell needs, the protocol's
# (docs/protocol.toml): near the 5k encoder's own accuracy on real Fashion-MNIST test images
# (87.8 %), so a kept cell's pure images are as recognisable as real ones
FIDELITY_FLOOR = PROTOCOL.fidelity_floor
# each a full mixed set: ~9 min of generate on 2 cores for Fashion-MNIST (the protocol's)
MAX_CELLS = PROTOCOL.max_cells
GENERATOR = "generator"  # the task that fits the generator (the chain's steps before generate)
CHAIN = "chain"  # set 0's chain, which generates at the chosen cell


@dataclass(frozen=True)
class Cell:
    guidance: float
    clip: str | None  # "on" | "off"; None: the fit did not choose clipping (its saved setting)

    @property
    def key(self) -> str:
        """w3-off, w1p5-on, w2 (no clipping choice): a folder- and run-name part."""
        return f"w{self.guidance:g}".replace(".", "p") + (f"-{self.clip}" if self.clip else "")

    def sets(self) -> list[str]:
        """generate's --set values of this cell (chain scope)."""
        clip = [f"generate.clip_sample={self.clip}"] if self.clip else []
        return [f"generate.guidance={self.guidance:g}", *clip]


def candidates(preset: str, chain_sets: Sequence[str]) -> list[Cell]:
    """Every cell fit-generator judges ([] when the chain fits no unet generator)."""
    steps = dict(chain_steps(preset))
    if "fit-generator" not in steps or "generate" not in steps:
        return []
    with scoped_errors("generate"):
        gen = resolve_stage_config(
            "generate", preset, [*steps["generate"], *split_sets(chain_sets, "generate")]
        )
    with scoped_errors("fit-generator"):
        fit = resolve_stage_config(
            "fit-generator",
            preset,
            [*steps["fit-generator"], *split_sets(chain_sets, "fit-generator")],
        )
    if gen.backend.name != "unet":
        return []
    clips = ("off", "on") if fit.fidelity.clip_choice else (None,)
    return [Cell(float(w), c) for c in clips for w in fit.fidelity.guidance_grid]


def cell_root(root: Path, cell: Cell) -> Path:
    return variant_root(root, f"cell-{cell.key}")


def fidelity(root: Path) -> tuple[dict[Cell, float], Cell, str]:
    """Every cell's endpoint fidelity at the fit's last check by its chooser judge, the fit's
    chosen cell, and the chooser's name (root/generator/fidelity.json)."""
    fid = read_json(root / "generator" / "fidelity.json")
    chooser = next(n for n, j in fid["judges"].items() if j["role"] == "chooses w")
    last = fid["curve"][-1]
    by_clip = last.get("clip") or {None: last["guidance"]}
    cells = {
        Cell(float(w), clip): float(by_judge[chooser]["accuracy"])
        for clip, by_w in by_clip.items()
        for w, by_judge in by_w.items()
    }
    clip = fid.get("clip_sample")
    chosen = Cell(float(fid["guidance"]), None if clip is None else "on" if clip else "off")
    return cells, chosen, chooser


def kept_cells(root: Path) -> tuple[list[Cell], Cell]:
    """The cells the study tries (in (clipping, w) order) and the fit's cell (the reference):
    those at or above FIDELITY_FLOOR, the fit's cell always; past MAX_CELLS, the fit's cell
    and the others evenly spread over the passing ones."""
    cells, reference, _ = fidelity(root)
    order = sorted(cells, key=lambda c: (c.clip or "", c.guidance))
    others = [c for c in order if c != reference and cells[c] >= FIDELITY_FLOOR]
    if len(others) > MAX_CELLS - 1:
        picks = np.linspace(0, len(others) - 1, MAX_CELLS - 1).round().astype(int)
        others = [others[i] for i in sorted(set(picks))]
    kept = set(others) | {reference}
    return [c for c in order if c in kept], reference


def tune_run(cell: Cell, seed: int = TUNE_SEED) -> str:
    return f"tune-cell-{cell.key}" + ("" if seed == TUNE_SEED else f"-t{seed}")


class CellReads:
    """One study invocation's reads of its cells (one per plan, asked by its cell tasks and its
    chains), each answer kept only while its files cannot have changed it. The kept cells:
    while fidelity.json is the file they were read from (its inode, mtime and size; any
    rewrite changes them, and a complete generator/ alone is not final: a fit-generator
    recheck replaces it). The chosen cell: the same, and only once every kept cell's tuning
    run was complete before the scores were read (a complete folder never changes); asked
    while runs are still going, it is read anew at the next ask. The key is taken before the
    files are read, so an answer is never kept under a newer file's key than its own."""

    def __init__(self, root: Path, seeds: Sequence[int]) -> None:
        self.root, self.seeds = root, tuple(seeds)
        self._kept: tuple[tuple[int, int, int], list[Cell]] | None = None
        self._chosen: tuple[tuple[int, int, int], Cell] | None = None

    def _fidelity_key(self) -> tuple[int, int, int]:
        st = (self.root / "generator" / "fidelity.json").stat()
        return st.st_ino, st.st_mtime_ns, st.st_size

    def kept(self) -> list[Cell]:
        """kept_cells' cells."""
        key = self._fidelity_key()
        if self._kept is None or self._kept[0] != key:
            self._kept = key, kept_cells(self.root)[0]
        return self._kept[1]

    def chosen(self) -> Cell:
        """The cell the rule chooses (choose_cell)."""
        key = self._fidelity_key()
        if self._chosen is not None and self._chosen[0] == key:
            return self._chosen[1]
        runs = [tune_run(c, s) for c in self.kept() for s in self.seeds]
        final = all(is_complete(self.root / "train" / r) for r in runs)
        c = choose_cell(self.root, self.seeds)["chosen"]
        cell = Cell(c["guidance"], c["clip"])
        if final:
            self._chosen = key, cell
        return cell


def _prepare_chain(reads: CellReads, cell: Cell) -> list[str] | None:
    """A cell's chain: nothing to do for a cell the study does not keep; else csm's upstream
    shared into the cell's root and the cell's generate settings."""
    if cell not in reads.kept():
        return None
    share_upstream(reads.root, cell_root(reads.root, cell))
    return cell.sets()


def _prepare_run(reads: CellReads, cell: Cell) -> list[str] | None:
    return [] if cell in reads.kept() else None


def _settled(reads: CellReads, cell: Cell, folder: Path) -> bool:
    """A cell task is done when its output is complete, or the fit has judged the cells and
    this one is not kept."""
    if is_complete(folder):
        return True
    try:
        return is_complete(reads.root / "generator") and cell not in reads.kept()
    except (OSError, KeyError, ValueError, StopIteration):  # fidelity.json unreadable: run
        return False


def generator_task(preset: str, chain_sets: Sequence[str], root: Path, after: str) -> Task:
    """The chain's steps after prepare and before generate (its encoder, judges, fit) as one
    task: the cells are read from what the fit recorded."""
    steps = []
    for stage, extra in chain_steps(preset):
        if stage == "generate":
            break
        if stage != "prepare":
            steps.append((stage, [*extra, *split_sets(chain_sets, stage)]))
    runs = [s.removeprefix("run=") for stage, sets in steps if stage == "train" for s in sets
            if s.startswith("run=")]  # fmt: skip
    done = is_complete(root / "generator") and all(is_complete(root / "train" / r) for r in runs)
    return Task(GENERATOR, steps, {after}, done)


class CellTasks(NamedTuple):
    """cell_tasks' tasks: each candidate cell's chain, and the csm runs on the cells' sets (the
    runs the choice reads, so set 0's chain waits for them)."""

    chains: list[Task]
    runs: list[Task]

    def in_order(self) -> list[Task]:
        """The plan's order: each cell's chain, then the runs that wait for it."""
        return [t for c in self.chains for t in (c, *(r for r in self.runs if c.name in r.after))]


def cell_tasks(
    reads: CellReads, cells: Sequence[Cell], chain_sets: Sequence[str], train_sets: Sequence[str]
) -> CellTasks:
    """Per candidate cell: its chain (chain-cell-<key>) and csm at the grid's reference point
    at every tuning seed (`reads.seeds`) on its set; a cell the study does not keep skips them
    (prepare None)."""
    root, tasks = reads.root, CellTasks([], [])
    point = set_values(REFERENCE["csm"])
    for cell in cells:
        c_root = cell_root(root, cell)
        v_sets = [*(s for s in chain_sets if not s.startswith("name=")), f"name={c_root.name}"]
        chain = f"chain-cell-{cell.key}"
        done = _settled(reads, cell, c_root / "mixed")
        prepare = functools.partial(_prepare_chain, reads, cell)
        tasks.chains.append(Task(chain, [("chain", v_sets)], {GENERATOR}, done, prepare))
        for seed in reads.seeds:
            name = tune_run(cell, seed)
            sets = [*train_sets, *METHODS["csm"].sets, f"mixed={c_root / 'mixed'}", *point,
                    f"run={name}", f"seed={seed}"]  # fmt: skip
            done = _settled(reads, cell, root / "train" / name)
            run = functools.partial(_prepare_run, reads, cell)
            tasks.runs.append(Task(name, [("train", sets)], {chain}, done, run))
    return tasks


def choose_cell(root: Path, seeds: Sequence[int]) -> dict[str, Any]:
    """The rule over the kept cells (each row: its values, fidelity, mean val scores over the
    tuning seeds, val NLL per seed, runs), the fit's cell the reference; study.json's
    "generator" with every candidate's fidelity."""
    cells, reference, chooser = fidelity(root)
    kept, _ = kept_cells(root)
    rows = []
    for cell in kept:
        runs = [tune_run(cell, s) for s in seeds]
        scores = [val_score(root / "train" / r) for r in runs]
        values = {"guidance": cell.guidance, "clip": cell.clip, "fidelity": cells[cell]}
        rows.append(score_row(tune_run(cell), values, scores, runs))
    rule = choose_point(rows, {"guidance": reference.guidance, "clip": reference.clip})
    chosen = rule.pop("chosen")
    return {
        "criterion": "mean val_nll of csm at its grid's reference point over the tuning seeds, "
        "among the cells at or above the fidelity floor; within one standard error: the fit's cell",
        "judge": chooser,
        "fidelity_floor": FIDELITY_FLOOR,
        "max_cells": MAX_CELLS,
        "at": REFERENCE["csm"],
        "seeds": list(seeds),
        "reference": {"guidance": reference.guidance, "clip": reference.clip},
        "rule": rule,
        "chosen": {"guidance": chosen["guidance"], "clip": chosen["clip"]},
        "chosen_run": chosen["run"],
        "cells": [
            {"guidance": c.guidance, "clip": c.clip, "fidelity": f, "kept": c in kept}
            for c, f in sorted(cells.items(), key=lambda cf: (cf[0].clip or "", cf[0].guidance))
        ],
        "grid": rows,
    }


def prepare_set0(reads: CellReads) -> list[str]:
    """Before set 0's chain: the chosen cell's series and mixed set taken by link (drawn with
    the same seed and settings, so the chain finds them complete), and its generate settings."""
    root, cell = reads.root, reads.chosen()
    for part in ("series", "mixed"):
        if is_complete(cell_root(root, cell) / part):
            link_complete(cell_root(root, cell) / part, root / part)
    return cell.sets()
