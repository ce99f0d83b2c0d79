"""Same bytes across commits: run the generation chain on two commits, on this machine, and
compare every file they wrote.

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
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
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


def failures(groups: dict[str, list[str]]) -> list[str]:
    """Data files that differ or exist on one side only."""
    return [p for key in ("differ", "only_a", "only_b") for p in groups[key] if is_data(p)]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the earlier commit")
    parser.add_argument("head", nargs="?", default="HEAD", help="the later commit (HEAD)")
    parser.add_argument("--preset", default="digits", help="the chain's preset (digits)")
    parser.add_argument("--set", nargs="*", default=[], dest="sets", help="chain overrides")
    parser.add_argument("--work", type=Path, help="keep the archives and roots here")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (this one)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="semix-bytes-"))
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
    for key, label in (("differ", "differ"), ("only_a", f"only at {args.base}"),
                       ("only_b", f"only at {args.head}")):  # fmt: skip
        for path in groups[key]:
            print(f"  {label}: {path}{'' if is_data(path) else ' (bookkeeping)'}")
    bad = failures(groups)
    print(
        f"{len(groups['same'])} files equal; data files differing: {len(bad)}; roots under {work}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
