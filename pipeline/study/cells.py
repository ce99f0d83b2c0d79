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
    recorded_names,
    score_row,
    set_values,
    val_score,
)
from shards.manifest import is_complete
from stages.configs.fit_generator import parse_sampler_cell
from stages.presets import chain_steps

# the endpoint fidelity (%, by the fit's chooser judge) a cell needs, the protocol's
# (docs/protocol.toml): near the 5k encoder's own accuracy on real Fashion-MNIST test images
# (87.8 %), so a kept cell's pure images are as recognisable as real ones
FIDELITY_FLOOR = PROTOCOL.fidelity_floor
# each a full mixed set: ~9 min of generate on 2 cores for Fashion-MNIST (the protocol's)
MAX_CELLS = PROTOCOL.max_cells
GENERATOR = "generator"  # the task that fits the generator (the chain's steps before generate)
# the chain root variant of the fit the cells are chosen on (<root>-cells), no comparison's
CELL_FIT = "cells"
CHAIN = "chain"  # set 0's chain, which generates at the chosen cell


# a cell's sampler in folder and run names
SAMPLER_KEYS = {"ddim": "ddim", "dpmsolver++": "dpmpp", "unipc": "unipc"}
# the denoiser's rows per second in bf16 over fp32 where the CPU computes bf16 natively
# (bench/RESULTS.md: 1.5x on the fashion UNet's rows); a cell's cost divides by it
BF16_SPEEDUP = 1.5


@dataclass(frozen=True)
class Cell:
    guidance: float
    clip: str | None  # "on" | "off"; None: the fit did not choose clipping (its saved setting)
    # "": the fit's own sampler and steps (generate's sampler and sample_steps); else one of
    # fit-generator's fidelity.samplers entries, e.g. unipc at 12 steps, bf16 or fp32 weights
    sampler: str = ""
    steps: int = 0
    precision: str = "fp32"

    @property
    def key(self) -> str:
        """w3-off, w1p5-on, w2 (no clipping choice), w1p5-on-unipc12, w2-dpmpp10-bf16: a
        folder- and run-name part naming every setting that differs from the fit's."""
        key = f"w{self.guidance:g}".replace(".", "p") + (f"-{self.clip}" if self.clip else "")
        if self.sampler:
            key += f"-{SAMPLER_KEYS[self.sampler]}{self.steps}"
        return key + ("-bf16" if self.precision == "bf16" else "")

    def sets(self) -> list[str]:
        """generate's --set values of this cell (chain scope)."""
        clip = [f"generate.clip_sample={self.clip}"] if self.clip else []
        out = [f"generate.guidance={self.guidance:g}", *clip]
        if self.sampler:
            out += [f"generate.sampler={self.sampler}", f"generate.sample_steps={self.steps}"]
        if self.precision == "bf16":
            out.append("generate.precision=bf16")
        return out

    def cost(self, reference_steps: int) -> float:
        """Denoiser passes per image in fp32 units: what drawing its mixed set costs, relative
        to the other cells (`reference_steps`: the fit's own sampler's steps)."""
        steps = self.steps or reference_steps
        return steps / (BF16_SPEEDUP if self.precision == "bf16" else 1.0)

    def values(self) -> dict[str, Any]:
        """The cell as study.json's rows name it."""
        return {"guidance": self.guidance, "clip": self.clip, "sampler": self.sampler,
                "steps": self.steps, "precision": self.precision}  # fmt: skip


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
    samplers = [("", 0, "fp32"), *map(parse_sampler_cell, fit.fidelity.samplers)]
    return [
        Cell(float(w), c, *sampler)
        for sampler in samplers
        for c in clips
        for w in fit.fidelity.guidance_grid
    ]


def reference_steps(preset: str, chain_sets: Sequence[str]) -> int:
    """The steps of the fit's own cell: generate's sample_steps in the chain."""
    steps = dict(chain_steps(preset)).get("generate", ())
    with scoped_errors("generate"):
        return resolve_stage_config(
            "generate", preset, [*steps, *split_sets(chain_sets, "generate")]
        ).sample_steps


def cell_root(root: Path, cell: Cell) -> Path:
    return variant_root(root, f"cell-{cell.key}")


def fidelity(root: Path) -> tuple[dict[Cell, float], Cell, str]:
    """Every cell's endpoint fidelity at the fit's last check by its chooser judge (the fit's
    own sampler's, and every fidelity.samplers entry's), the fit's chosen cell, and the
    chooser's name (root/generator/fidelity.json)."""
    fid = read_json(root / "generator" / "fidelity.json")
    chooser = next(n for n, j in fid["judges"].items() if j["role"] == "chooses w")
    last = fid["curve"][-1]
    points = {("", 0, "fp32"): last}
    points |= {parse_sampler_cell(e): p for e, p in last.get("samplers", {}).items()}
    cells = {
        Cell(float(w), clip, *sampler): float(by_judge[chooser]["accuracy"])
        for sampler, point in points.items()
        for clip, by_w in (point.get("clip") or {None: point["guidance"]}).items()
        for w, by_judge in by_w.items()
    }
    clip = fid.get("clip_sample")
    chosen = Cell(float(fid["guidance"]), None if clip is None else "on" if clip else "off")
    return cells, chosen, chooser


def _order(cell: Cell) -> tuple:
    return (cell.clip or "", cell.guidance, cell.sampler, cell.steps, cell.precision)


def kept_cells(root: Path, reference_steps: int = 25) -> tuple[list[Cell], Cell]:
    """The cells the study tries (in (clipping, w, sampler) order) and the fit's cell (the
    reference): those at or above FIDELITY_FLOOR, the fit's cell always, at most MAX_CELLS:
    after the fit's, the cheapest faster cell at the fit's (w, clipping) that passes (the
    speed lever, tried whenever one passes), then the others evenly spread over the passing
    ones."""
    cells, reference, _ = fidelity(root)
    order = sorted(cells, key=_order)
    passing = [c for c in order if c != reference and cells[c] >= FIDELITY_FLOOR]
    same = (reference.guidance, reference.clip)
    faster = [c for c in passing if (c.guidance, c.clip) == same
              and c.cost(reference_steps) < reference.cost(reference_steps)]  # fmt: skip
    kept = {reference}
    if faster and MAX_CELLS > 1:
        kept.add(min(faster, key=lambda c: (c.cost(reference_steps), _order(c))))
    others = [c for c in passing if c not in kept]
    room = MAX_CELLS - len(kept)
    if len(others) > room:
        picks = np.linspace(0, len(others) - 1, room).round().astype(int) if room > 0 else []
        others = [others[i] for i in sorted(set(picks))]
    kept |= set(others)
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

    def __init__(
        self,
        root: Path,
        seeds: Sequence[int],
        fit_root: Path | None = None,
        fit_sets: Sequence[str] = (),
        reference_steps: int = 25,
    ) -> None:
        """`root`: the study's (its train/ holds the cells' runs); `fit_root`: the chain root
        whose generator the cells are drawn from (default `root`), made with the chain-scope
        `fit_sets` (its fit-generator seed); `reference_steps`: the fit's own cell's steps."""
        self.root, self.seeds = root, tuple(seeds)
        self.fit_root, self.fit_sets = fit_root or root, list(fit_sets)
        self.reference_steps = reference_steps
        self._kept: tuple[tuple[int, int, int], list[Cell]] | None = None
        self._chosen: tuple[tuple[int, int, int], Cell] | None = None

    def _fidelity_key(self) -> tuple[int, int, int]:
        st = (self.fit_root / "generator" / "fidelity.json").stat()
        return st.st_ino, st.st_mtime_ns, st.st_size

    def kept(self) -> list[Cell]:
        """kept_cells' cells."""
        key = self._fidelity_key()
        if self._kept is None or self._kept[0] != key:
            self._kept = key, kept_cells(self.fit_root, self.reference_steps)[0]
        return self._kept[1]

    def chosen(self) -> Cell:
        """The cell the rule chooses (choose_cell)."""
        key = self._fidelity_key()
        if self._chosen is not None and self._chosen[0] == key:
            return self._chosen[1]
        runs = [tune_run(c, s) for c in self.kept() for s in self.seeds]
        final = all(is_complete(self.root / "train" / r) for r in runs)
        c = choose_cell(self.root, self.seeds, self.fit_root, self.reference_steps)["chosen"]
        cell = Cell(**c)
        if final:
            self._chosen = key, cell
        return cell


def _prepare_chain(reads: CellReads, cell: Cell) -> list[str] | None:
    """A cell's chain: nothing to do for a cell the study does not keep; else csm's upstream
    shared into the cell's root and the cell's generate settings."""
    if cell not in reads.kept():
        return None
    share_upstream(reads.fit_root, cell_root(reads.root, cell))
    return [*reads.fit_sets, *cell.sets()]


def _prepare_run(reads: CellReads, cell: Cell) -> list[str] | None:
    return [] if cell in reads.kept() else None


def _settled(reads: CellReads, cell: Cell, folder: Path) -> bool:
    """A cell task is done when its output is complete, or the fit has judged the cells and
    this one is not kept."""
    if is_complete(folder):
        return True
    try:
        return is_complete(reads.fit_root / "generator") and cell not in reads.kept()
    except (OSError, KeyError, ValueError, StopIteration):  # fidelity.json unreadable: run
        return False


def generator_task(
    preset: str, chain_sets: Sequence[str], root: Path, after: str, fit: bool = True
) -> Task:
    """The chain's steps after prepare and before generate (its encoder, judges, and with
    `fit` the fit) as one task; without `fit` the study fits its generators in tasks of their
    own (plan.fit_task), which start as soon as this one is done."""
    steps = []
    for stage, extra in chain_steps(preset):
        if stage == "generate" or (stage == "fit-generator" and not fit):
            break
        if stage != "prepare":
            steps.append((stage, [*extra, *split_sets(chain_sets, stage)]))
    runs = [s.removeprefix("run=") for stage, sets in steps if stage == "train" for s in sets
            if s.startswith("run=")]  # fmt: skip
    done = all(is_complete(root / "train" / r) for r in runs)
    done = done and (not fit or is_complete(root / "generator"))
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
    reads: CellReads,
    cells: Sequence[Cell],
    chain_sets: Sequence[str],
    train_sets: Sequence[str],
    after: str = GENERATOR,
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
        tasks.chains.append(Task(chain, [("chain", v_sets)], {after}, done, prepare))
        for seed in reads.seeds:
            name = tune_run(cell, seed)
            sets = [*train_sets, *METHODS["csm"].sets, f"mixed={c_root / 'mixed'}", *point,
                    f"run={name}", f"seed={seed}"]  # fmt: skip
            done = _settled(reads, cell, root / "train" / name)
            run = functools.partial(_prepare_run, reads, cell)
            tasks.runs.append(Task(name, [("train", sets)], {chain}, done, run))
    return tasks


def cheapest_within_noise(
    rows: Sequence[dict[str, Any]], chosen: dict[str, Any], cost: dict[str, float]
) -> dict[str, Any]:
    """The rule's cost step: among the rows no worse than the rule's `chosen` row by more than
    one standard error of their paired per-seed val-NLL differences (the noise the rule ignores
    in the other direction too), the cheapest (`cost` by run; ties: the lower mean val NLL,
    then `chosen`). A row whose val NLL is not finite never qualifies."""

    def within(row: dict[str, Any]) -> bool:
        if row is chosen:
            return True
        if not np.isfinite(row["val_nll_seeds"]).all():
            return False
        gaps = np.asarray(row["val_nll_seeds"]) - np.asarray(chosen["val_nll_seeds"])
        se = gaps.std(ddof=1) / np.sqrt(len(gaps)) if len(gaps) > 1 else 0.0
        return bool(gaps.mean() <= se)

    close = [r for r in rows if within(r)]
    return min(close, key=lambda r: (cost[r["run"]], r is not chosen, np.mean(r["val_nll_seeds"])))


def choose_cell(
    root: Path, seeds: Sequence[int], fit_root: Path | None = None, reference_steps: int = 25
) -> dict[str, Any]:
    """The rule over the kept cells (each row: its values, fidelity, mean val scores over the
    tuning seeds, val NLL per seed, runs), the fit's cell the reference, then its cost step
    (cheapest_within_noise); study.json's "generator" with every candidate's fidelity. The
    cells are fit_root's generator's (default: root's), the runs root's."""
    fit_root = fit_root or root
    cells, reference, chooser = fidelity(fit_root)
    kept, _ = kept_cells(fit_root, reference_steps)
    rows, cost = [], {}
    for cell in kept:
        runs = [tune_run(cell, s) for s in seeds]
        scores = [val_score(root / "train" / r) for r in runs]
        values = {**cell.values(), "fidelity": cells[cell]}
        rows.append(score_row(tune_run(cell), values, scores, runs))
        cost[tune_run(cell)] = cell.cost(reference_steps)
    rule = choose_point(rows, reference.values())
    by_rule = rule.pop("chosen")
    chosen = cheapest_within_noise(rows, by_rule, cost)
    rule["by_cost"] = chosen is not by_rule  # the rule's choice gave way to a cheaper cell
    return {
        "criterion": "mean val_nll of csm at its grid's reference point over the tuning seeds, "
        "among the cells at or above the fidelity floor; within one standard error: the fit's "
        "cell; then the cheapest cell within one standard error of that choice",
        "judge": chooser,
        "fidelity_floor": FIDELITY_FLOOR,
        "max_cells": MAX_CELLS,
        "at": recorded_names("csm", REFERENCE["csm"]),  # under study.json's names
        "seeds": list(seeds),
        "reference_steps": reference_steps,
        "reference": reference.values(),
        "rule": rule,
        "chosen": {k: chosen[k] for k in reference.values()},
        "chosen_run": chosen["run"],
        "cells": [
            {**c.values(), "fidelity": f, "kept": c in kept, "cost": c.cost(reference_steps)}
            for c, f in sorted(cells.items(), key=lambda cf: _order(cf[0]))
        ],
        "grid": rows,
    }


def prepare_set0(reads: CellReads) -> list[str]:
    """Before set 0's chain: the chosen cell's generate settings; when the cells were drawn from
    this root's own generator (a study without a separate cell fit), the chosen cell's series
    and mixed set taken by link (drawn with the same seed and settings, so the chain finds
    them complete)."""
    root, cell = reads.root, reads.chosen()
    for part in ("series", "mixed") if reads.fit_root == root else ():
        if is_complete(cell_root(root, cell) / part):
            link_complete(cell_root(root, cell) / part, root / part)
    return cell.sets()
