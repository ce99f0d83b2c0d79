"""Same bytes across commits: run the generation chain on two commits, on this machine, and
compare every file they wrote; or (--study) check that a study root written by the earlier
commit is complete for the later one.

Float bytes belong to a machine (oneDNN picks kernels by CPU), so the test suite never pins
them. Whether a change kept the bytes of an earlier commit is a question for one machine at a
time: this script builds both commits from clean archives, runs the same chain with the same
virtual environment one after the other, and compares the two roots file by file.

    python tests/cross_commit.py 40d77dd                  # that commit against HEAD
    python tests/cross_commit.py 40d77dd HEAD --set generate.limit=20 fit-generator.steps=100
    make bytes-check BASE=40d77dd [HEAD=...] [SET="..."]  # the same

Data files (shards, weights, images, arrays, prototypes, the annotation report) must be equal;
bookkeeping files (manifests, which record the commit, host records, logs) are listed, not
judged. Exit 0 when every data file is equal, 1 otherwise.

The study half: a small study (STUDY_SETS: ce's and csm's tuning grids, MaC-Cal's grid and runs,
train, evaluate, the report) is run with the earlier commit's code into one root, then the later
commit's study with the same command on the same root:

    python tests/cross_commit.py 6a7870d HEAD --study     # 82 tasks, one-epoch runs
    make bytes-check BASE=6a7870d STUDY=1                 # the same

The later commit must find nothing to run (the "N of M tasks to run" line of its log; its
study/host.json, which records the tasks an invocation ran, must list none) and leave every file
of the root as it was (study_role): study.json, report.md and protocol.lock, and every run's
config.json, weights and evaluation; study/host.json and study/logs/ are bookkeeping and the
figures (study/*.png) are drawn again by the later commit's plotting code, so those are listed,
not judged. Exit 0 when nothing ran and nothing judged changed, 1 otherwise, 2 when the earlier
commit's study itself failed (7b450c4's, for one, refuses study.fits: generator fits and the
protocol came later). A BASE whose docs/protocol.toml differs from the later one's (any before
6a7870d) cannot keep study.json's bytes: the later study records the protocol as changed since
the start (its verdicts exploratory); the script says so before it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from core.io import sha256_file

REPO = Path(__file__).resolve().parents[1]
DATA_SUFFIXES = (".tar", ".safetensors", ".png", ".npz", ".npy")
DATA_NAMES = ("prototypes.json", "annotation.json")


def is_data(relpath: str) -> bool:
    """A file whose bytes are the chain's result, not its bookkeeping."""
    name = relpath.rsplit("/", 1)[-1]
    return name.endswith(DATA_SUFFIXES) or name in DATA_NAMES


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def compare(a: dict[str, str], b: dict[str, str]) -> dict[str, list[str]]:
    """Paths grouped as same / differ / only_a / only_b."""
    out: dict[str, list[str]] = {"same": [], "differ": [], "only_a": [], "only_b": []}
    for path in sorted(a.keys() | b.keys()):
        if path not in b:
            out["only_a"].append(path)
        elif path not in a:
            out["only_b"].append(path)
        else:
            out["same" if a[path] == b[path] else "differ"].append(path)
    return out


def failures(groups: dict[str, list[str]], judged: Callable[[str], bool] = is_data) -> list[str]:
    """The judged files (the chain's: data files) that differ or exist on one side only."""
    return [p for key in ("differ", "only_a", "only_b") for p in groups[key] if judged(p)]


def listing(groups: dict[str, list[str]], base: str, head: str, note: Callable[[str], str]) -> None:
    """Print every path that differs or exists on one side only, `note(path)` after it."""
    for key, label in (("differ", "differ"), ("only_a", f"only at {base}"),
                       ("only_b", f"only at {head}")):  # fmt: skip
        for path in groups[key]:
            print(f"  {label}: {path}{note(path)}")


def archive(commit: str, dest: Path) -> str:
    """Unpack ``commit``'s tree into ``dest``; its full hash."""
    full = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    dest.mkdir(parents=True)
    blob = subprocess.run(["git", "-C", str(REPO), "archive", full], check=True,
                          capture_output=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    return full


def run_chain(code: Path, out: Path, preset: str, sets: list[str], python: str) -> float:
    """The chain of ``code``'s tree into ``out``; wall seconds."""
    env = os.environ | {"PYTHONPATH": str(code)}  # the archive's modules, not the editable install
    cmd = [python, "-m", "pipeline", "chain", "--preset", preset, "--set", f"out={out}", *sets]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=code, env=env, check=True)
    return time.perf_counter() - start


# ---------------------------------------------------------------- the study half (--study)

# The smallest study that still plans every kind of task the vocabulary work renamed or
# re-spelt: ce's and csm's tuning grids (tune-* tasks; csm's w and s are paths now), MaC-Cal's
# grid and runs (finetune's objective=, was method=), train stacks, evaluations and the report.
# One generator fit of 2 steps and one mixed set, no cell tuning, no shift or OOD sets, one
# epoch everywhere; two seeds, so the report has intervals. Tree paths: every commit since the
# config tree takes them. Extra --set values come after these (a later value wins).
STUDY_SETS = (
    "study.methods=ce,csm,ce+maccal", "study.seeds=0,1", "study.tune_seeds=2",
    "study.fits=1", "study.mixed_sets=1", "study.cells=false", "study.robustness=false",
    "study.bootstrap=100", "train.epochs=1", "train.optim.milestones=",
    "finetune.maccal.epochs=1", "fit-generator.train_steps=2",
    "fit-generator.fidelity.per_class=2", "fit-generator.preview.sample_steps=2",
    "generate.sample_steps=2", "generate.mixing.series_per_pair=1",
)  # fmt: skip
PROTOCOL = "docs/protocol.toml"  # its sha256 goes to study.json, and the one at the start
TASKS_LINE = re.compile(r"(\d+) of (\d+) tasks to run")  # the study's first log line says it


def study_role(relpath: str) -> str:
    """A file of the study's out/ (`relpath` from it: <root>/study/study.json) as the study half
    judges it: "bookkeeping" (the study folder's host.json, the seconds of each invocation, and
    its logs/), "figure" (the study folder's *.png, drawn again by the later commit's plotting
    code at every invocation) or "kept": everything else, which an invocation with nothing to
    run must leave as it was (study.json, report.md, protocol.lock; every run's config.json,
    weights and metrics, every evaluation, the chain's outputs)."""
    parts = relpath.split("/")
    if len(parts) < 3 or parts[1] != "study":
        return "kept"
    rest = "/".join(parts[2:])
    if rest == "host.json" or rest.startswith("logs/"):
        return "bookkeeping"
    return "figure" if rest.endswith(".png") else "kept"


def is_kept(relpath: str) -> bool:
    return study_role(relpath) == "kept"


def tasks_ran(host: Path) -> list[str] | None:
    """The tasks the last invocation ran, from its study/host.json; None when it records none
    (no file, or not in the form the study writes)."""
    try:
        seconds = json.loads(host.read_text())["task_seconds_this_invocation"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return list(seconds) if isinstance(seconds, dict) else None


def run_study(
    code: Path, out: Path, preset: str, sets: list[str], python: str, log: Path | None = None
) -> tuple[int, float]:
    """The study of ``code``'s tree into ``out`` (its output to ``log`` when given); (exit
    status, wall seconds)."""
    env = os.environ | {"PYTHONPATH": str(code)}  # its tasks inherit it: the archive's modules
    cmd = [python, "-m", "pipeline", "study", "--preset", preset, "--set", f"out={out}", *sets]
    start = time.perf_counter()
    if log is None:
        rc = subprocess.run(cmd, cwd=code, env=env).returncode
    else:
        with open(log, "w", encoding="utf-8") as f:
            rc = subprocess.run(
                cmd, cwd=code, env=env, stdout=f, stderr=subprocess.STDOUT
            ).returncode
    return rc, time.perf_counter() - start


def study_check(args: argparse.Namespace, work: Path) -> int:
    """The study half: BASE's study into one root, then HEAD's on it (judge_study); 2 when
    BASE's study failed."""
    codes, fulls = {}, {}
    for tag, commit in (("a", args.base), ("b", args.head)):
        codes[tag] = work / f"code-{tag}"
        fulls[tag] = archive(commit, codes[tag])
    protocols = [codes[tag] / PROTOCOL for tag in "ab"]
    if not all(p.is_file() for p in protocols) or len({p.read_bytes() for p in protocols}) > 1:
        print(
            f"note: {PROTOCOL} differs between {args.base} and {args.head} (or one has none): "
            f"{args.head}'s study.json records the protocol as changed, so study.json and "
            "report.md cannot keep their bytes"
        )
    out, sets = work / "out", [*STUDY_SETS, *args.sets]
    rc, seconds = run_study(codes["a"], out, args.preset, sets, args.python)
    if rc:
        print(f"{args.base} ({fulls['a'][:12]}): its study failed (exit {rc}): nothing to judge")
        return 2
    before = tree(out)
    print(f"{args.base} ({fulls['a'][:12]}): study in {seconds:.0f} s, {len(before)} files")
    log = work / "study-b.log"
    rc, seconds = run_study(codes["b"], out, args.preset, sets, args.python, log)
    text = log.read_text(encoding="utf-8", errors="replace")
    head = f"{args.head} ({fulls['b'][:12]})"
    if rc:
        last = ([s for s in text.splitlines() if s.strip()] or ["no output"])[-1]
        print(f"{head}: its study failed on the root (exit {rc}): {last}")
        print(f"its log: {log}; root under {out}")
        return 1
    line = TASKS_LINE.search(text)
    print(f"{head}: study in {seconds:.0f} s: {line[0] if line else 'no tasks line'} ({log})")
    return judge_study(out, before, args.base, args.head)


def judge_study(out: Path, before: dict[str, str], base: str, head: str) -> int:
    """The later commit's invocation on the study's out/, judged against `before` (tree(out)
    after the earlier one's): 0 when its study/host.json lists no task run and every kept file
    (study_role) is as it was, 1 otherwise. Prints what ran, every path that changed, the state
    of study.json and report.md, and how many config.json files changed."""
    studies = sorted(out.glob("*/study/host.json"))
    ran = tasks_ran(studies[0]) if len(studies) == 1 else None
    if ran is None:
        print(f"  {head} recorded no invocation: {len(studies)} study/host.json under {out}")
    else:
        print(f"  tasks {head} ran: {len(ran)}" + (f" ({', '.join(ran)})" if ran else ""))
    after = tree(out)
    groups = compare(before, after)
    listing(groups, base, head, lambda p: "" if is_kept(p) else f" ({study_role(p)})")
    folder = studies[0].parent.relative_to(out).as_posix() if studies else "*/study"
    for name in ("study.json", "report.md"):
        path = f"{folder}/{name}"
        state = "equal" if path in groups["same"] else "missing" if path not in after else "DIFFER"
        print(f"  {path}: {state}")
    configs = [p for p in before if p.rsplit("/", 1)[-1] == "config.json"]
    print(f"  config.json files: {len(configs)}, changed or gone: "
          f"{sum(p not in groups['same'] for p in configs)}")  # fmt: skip
    bad = failures(groups, is_kept)
    kept = sum(is_kept(p) for p in groups["same"])
    print(f"{kept} kept files equal; kept files changed: {len(bad)}; root under {out}")
    return 1 if bad or ran != [] else 0


def chain_check(args: argparse.Namespace, work: Path) -> int:
    """The chain half: the chain of each commit into its own root; 0 when every data file is
    equal."""
    roots, hashes = {}, {}
    for tag, commit in (("a", args.base), ("b", args.head)):
        full = archive(commit, work / f"code-{tag}")
        roots[tag] = work / f"out-{tag}"
        seconds = run_chain(work / f"code-{tag}", roots[tag], args.preset, args.sets, args.python)
        hashes[tag] = tree(roots[tag])
        print(f"{commit} ({full[:12]}): chain in {seconds:.0f} s, {len(hashes[tag])} files")
    groups = compare(hashes["a"], hashes["b"])
    data = [p for p in hashes["a"] if is_data(p)]
    digest = hashlib.sha256("".join(f"{hashes['a'][p]}  {p}\n" for p in data).encode())
    print(
        f"data files: {len(data)}, sha256 of their sha256 list at {args.base}: {digest.hexdigest()}"
    )
    listing(groups, args.base, args.head, lambda p: "" if is_data(p) else " (bookkeeping)")
    bad = failures(groups)
    print(
        f"{len(groups['same'])} files equal; data files differing: {len(bad)}; roots under {work}"
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the earlier commit")
    parser.add_argument("head", nargs="?", default="HEAD", help="the later commit (HEAD)")
    parser.add_argument("--preset", default="digits", help="the chain's preset (digits)")
    parser.add_argument(
        "--set", nargs="*", default=[], dest="sets", help="chain (--study: study) overrides"
    )
    parser.add_argument("--work", type=Path, help="keep the archives and roots here")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (this one)")
    parser.add_argument(
        "--study", action="store_true", help="a BASE study root rerun by HEAD: 0 tasks, same bytes"
    )
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="semix-bytes-"))
    return study_check(args, work) if args.study else chain_check(args, work)


if __name__ == "__main__":
    sys.exit(main())
