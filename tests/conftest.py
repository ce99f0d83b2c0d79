"""Shared fixtures: small real data on disk, built once per session."""

from __future__ import annotations

import ast
import builtins
import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("SEMIX_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_configure(config):
    """Under pytest-xdist (`make test`: -n auto), each worker's torch gets its share of the
    cores, so N workers never run N x cores threads (OpenMP oversubscribed on a 2-core machine
    spins more than it computes). Serial runs keep torch's default; the environment is left
    alone (tests check how stages read OMP_NUM_THREADS)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The longest work units of the tier, longest first: node-id prefixes (a whole module where the
# module is one xdist_group). Ranked by `make test PYTEST_ADDOPTS=--durations=60` on a fresh
# clone of 4a0fa6a (2 cores, bench/RESULTS.md), a group by the sum of its tests; re-rank them
# from a new profile. Nothing here is skipped or added: only the order changes.
HEAVY_FIRST = (
    "tests/test_study_cells.py::test_the_cell_is_chosen_on_a_tiny_fit_and_set_0_drawn_at_it",
    "tests/test_finetune.py",  # >= 86 s (before its source run read 640 images, not all)
    "tests/test_launch.py::test_rerun_of_complete_work_under_torchrun_exits_0_every_time",
    "tests/test_study.py::test_study_runs_reports_and_resumes_only_what_is_missing",
    "tests/test_fit_generator.py::test_a_kill_at_every_point_of_a_checkpoint_save_resumes",
    "tests/test_multinode.py",  # >= 48 s
    "tests/test_generate.py",  # >= 47 s
    "tests/test_evaluate.py",  # >= 47 s
    "tests/test_contributing_stage.py::test_a_stage_from_your_own_module_runs_through_the_cli",
    "tests/test_train.py::test_one_and_two_processes_train_alike",
    "tests/test_docs.py::test_every_documented_command_parses_and_resolves_its_config",
    "tests/test_annotate.py",  # >= 28 s
    "tests/test_train.py::test_killed_run_resumes_to_identical_weights",
    "tests/test_contributing.py::test_a_loss_from_your_own_module_trains_through_the_cli",
    "tests/test_contributing_backend.py::test_its_parameters_are_leaves_of_the_backend_section",
    "tests/test_kway.py",  # many tests of 1-4 s each
    "tests/test_faults.py",  # many tests of 1-5 s each
    "tests/test_train.py::test_a_kill_while_writing_the_outputs",
    # with the coverage tests below: one xdist_group, their simulations cached (~17 s less)
    "tests/test_study_intervals.py::test_what_the_primary_interval_does_that_the_others_do_not",
    "tests/test_contributing.py::test_a_preset_from_your_own_module_extends_one",
    "tests/test_cli.py::test_resolving_configs_and_a_backend_check_import_no_diffusers",
    "tests/test_stack.py::test_a_killed_stack_resumes_to_the_bytes_of_one_not_killed",
    "tests/test_fit_generator.py::test_resume_gives_the_same_weights",
    "tests/test_study_fresh.py::test_a_study_on_a_fresh_root_runs_end_to_end",
    "tests/test_study_intervals.py::test_the_primary_interval_covers_the_truth_with_few_seeds",
    "tests/test_study_tune.py::test_a_tiny_grid_runs_chooses_on_val_and_is_not_run_again",
    "tests/test_shift.py",
)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the heaviest work first (HEAVY_FIRST), the rest in file order: a
    long test dispatched last keeps one worker busy while the other idles (`make test` turns
    xdist's own reordering off for this). Every worker sorts the same collection the same way,
    as xdist requires. A serial run keeps file order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return

    def rank(item) -> int:
        return next(
            (i for i, prefix in enumerate(HEAVY_FIRST) if item.nodeid.startswith(prefix)),
            len(HEAVY_FIRST),
        )

    items.sort(key=rank)  # stable: file order within a rank


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m pipeline` subprocesses run from any cwd."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ---------------------------------------------------------------- parts from your own module
# (tests/test_contributing*.py: a toy loss, preset, backend, stage added with no semix edit)
SEMIX_PACKAGES = ("core", "models", "shards", "stages", "pipeline")


def semix_sources() -> dict[str, str]:
    """sha256 of every semix source file: the same before and after, or a file had to change."""
    return {
        p.relative_to(REPO).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for pkg in SEMIX_PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
    }


def write_plugins(folder: Path, **modules: str) -> Path:
    """`folder` with one module per keyword (name -> source, dedented): a user's own code."""
    folder.mkdir()
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return folder


def run_with_plugins(folder: Path, modules: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` with SEMIX_PLUGINS=`modules` importable from `folder`, as a user would run it."""
    env = subprocess_env() | {"SEMIX_PLUGINS": modules}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=folder.parent, timeout=600
    )


# run_many_with_plugins' one process: each argv through pipeline.cli.main as `python -m
# pipeline` runs it, its stdout and stderr apart, an argparse exit as its code; a fresh
# warnings state per call, so a note printed once a process prints on every call; the results
# as the last line of the process's own stdout
_MANY = """
import contextlib, io, json, sys, warnings
from pipeline.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    warnings.formatwarning = formatwarning
    results.append([rc, out.getvalue(), err.getvalue()])
sys.__stdout__.write("\\n" + json.dumps(results) + "\\n")
"""


def run_many_with_plugins(
    folder: Path, modules: str, argvs: list[list[str]]
) -> list[subprocess.CompletedProcess]:
    """`python -m pipeline *argv` for each of `argvs`, in turn, as run_with_plugins runs one,
    but all in one new process (one interpreter start instead of one each): for consecutive
    calls with nothing done between them. Each call's own rc, stdout and stderr."""
    done = run_with_plugins(folder, modules, [sys.executable, "-c", _MANY, json.dumps(argvs)])
    assert done.returncode == 0, done.stderr[-2000:]
    return [
        subprocess.CompletedProcess([sys.executable, "-m", "pipeline", *argv], rc, out, err)
        for argv, (rc, out, err) in zip(
            argvs, json.loads(done.stdout.splitlines()[-1]), strict=True
        )
    ]


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """os.environ is exactly `env` inside the block, and what it was again after it."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def run_pipeline_here(argv: list[str], out, env: dict[str, str]) -> int:
    """`python -m pipeline *argv` run in this process: the same entry point
    (pipeline/__main__.py calls pipeline.cli.main and exits with its code), the same argv, the
    same environment, and stdout/stderr into `out` as the subprocess's would be. An argparse
    exit becomes its code, as the process's would. What differs is only the interpreter's
    start-up and torch's process state (threads: the stages pin and restore their own,
    core/launch.py's cpu_threads, as in a chain). Python warnings go to pytest's warnings
    summary, not to `out`. Processes the stage itself starts (a chain's torchrun generate)
    are real ones, writing to this process's own output."""
    formatwarning = warnings.formatwarning  # main sets it for its own lines
    try:
        with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            from pipeline.cli import main

            try:
                return main(argv)
            except SystemExit as e:  # argparse's usage error or --help
                return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        warnings.formatwarning = formatwarning
        out.flush()


@pytest.fixture
def tasks_in_process(monkeypatch):
    """The study's task commands (`python -m pipeline <stage> ...`) run in this process
    (run_pipeline_here) instead of a new interpreter each: for tests of what a study decides
    and writes, not of how it starts processes (test_study.py's study and test_study_fresh.py's
    failure keep real ones). Only the `subprocess` that pipeline/study/execute.py sees is
    replaced; its other commands (git) and every other module's subprocesses stay real. Run
    the study with jobs=1: two tasks at once would share this process's stdout."""
    from pipeline.study import execute

    busy = threading.Lock()

    def run(cmd, *, stdout=None, stderr=None, env=None, **kwargs):
        if list(cmd[:3]) != [sys.executable, "-m", "pipeline"] or stderr != subprocess.STDOUT:
            return subprocess.run(cmd, stdout=stdout, stderr=stderr, env=env, **kwargs)
        assert not kwargs, f"in-process task run with unexpected arguments {kwargs}"
        if not busy.acquire(blocking=False):
            raise RuntimeError("two study tasks in-process at once: run the study with jobs=1")
        try:
            rc = run_pipeline_here(list(cmd[3:]), stdout, env or dict(os.environ))
        finally:
            busy.release()
        return subprocess.CompletedProcess(cmd, rc)

    fake = types.SimpleNamespace(
        run=run, STDOUT=subprocess.STDOUT, SubprocessError=subprocess.SubprocessError
    )
    monkeypatch.setattr(execute, "subprocess", fake)


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """runs/digits/ with real/{train,val,test} prepared once for the whole session.

    Read-only for tests: copy it (shutil.copytree) before writing next to it.
    """
    from pipeline.registry import run_stage

    out = tmp_path_factory.mktemp("runs")
    run_stage("prepare", "digits", [f"out={out}"])
    return out / "digits"


# ---------------------------------------------------------------- artefacts several files read
# Built once per worker (session scope) instead of once per module that builds the same thing:
# the same seeds and configs as the modules used, so the bytes are the ones they built.
# Read-only: a test copies (shutil.copytree) what it writes into.

# train/ce at the smallest size a finished run needs (test_values_runs, test_bad_input, test_faults)
TINY_TRAIN = ["epochs=1", "train_limit=64", "batch_size=32"]
# generate's reference series from the seed-0 random unet (test_generate, test_multinode): 24
# series of K = 4 in 12 shards; 8 rows per shard = one padded model call
REFERENCE_SERIES = ["alphas=4", "steps=6", "limit=24", "series_per_shard=2"]


@pytest.fixture(scope="session")
def tiny_ce_root(digits_root, tmp_path_factory) -> Path:
    """runs/digits/ with real/ and one finished train run `ce` at TINY_TRAIN."""
    from core.launch import cpu_threads
    from pipeline.registry import run_stage

    out = tmp_path_factory.mktemp("tiny-ce")
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    with cpu_threads(1):  # as the modules that built it ran it (digits' train pins 1 anyway)
        run_stage("train", "digits", [f"out={out}", *TINY_TRAIN])
    return out / "digits"


@pytest.fixture(scope="session")
def generator_root(digits_root, tmp_path_factory) -> Path:
    """runs/digits/ with real/ and a random-weight unet generator/ in fit-generator's format,
    its weights drawn from seed 0 without touching the global RNG."""
    import torch

    from models.generators import build_unet

    root = tmp_path_factory.mktemp("generator-src") / "digits"
    shutil.copytree(digits_root / "real", root / "real")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = build_unet(16, num_classes=10, channels=(16, 32), attention=(False, True))
    save_generator(root, unet)
    return root


@pytest.fixture(scope="session")
def generated_reference(generator_root, tmp_path_factory) -> Path:
    """series/ of one plain single-process generate at REFERENCE_SERIES from generator_root,
    one torch thread (as torchrun's ranks run): what every determinism test compares with."""
    from core.launch import cpu_threads
    from pipeline.registry import run_stage

    out = tmp_path_factory.mktemp("generate-ref")
    shutil.copytree(generator_root, out / "digits")
    with cpu_threads(1):
        return run_stage("generate", "digits", [f"out={out}", *REFERENCE_SERIES])


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (opt in with `pytestmark = pytest.mark.usefixtures(...)`):
    on a shared 2-core machine OpenMP's second thread makes tiny CPU kernels much slower, and
    CPU bytes can depend on the thread count."""
    from core.launch import cpu_threads

    with cpu_threads(1):
        yield


def tiny_openclip(
    folder: Path, name: str, *, layers: int = 1, width: int = 32, head_width: int = 16
):
    """A random-weight OpenCLIP model registered under `name` from a config file in `folder`
    (vision 32x32, tiny text tower), seeded without touching the global RNG."""
    import json

    import open_clip
    import torch

    cfg = {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "layers": layers,
            "width": width,
            "patch_size": 8,
            "head_width": head_width,
        },
        "text_cfg": {
            "context_length": 16,
            "vocab_size": 49408,
            "width": 32,
            "heads": 2,
            "layers": 1,
        },
    }
    (folder / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder / f"{name}.json")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return open_clip.create_model(name, pretrained=None).eval()


def tiny_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
    )


@pytest.fixture
def read_only(monkeypatch):
    """read_only(root): every write, rename, removal or mkdir under `root` fails with EROFS, as
    on read-only media (the tests run as root, so file modes would not stop anything)."""

    def guard(root: Path) -> None:
        root = str(root.resolve())

        def inside(path) -> bool:
            try:
                return os.path.abspath(os.fspath(path)).startswith(root)
            except TypeError:  # a file descriptor
                return False

        def refuse(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

        real_open = builtins.open

        def open_(file, mode="r", *args, **kwargs):
            if inside(file) and any(c in mode for c in "wax+"):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def wrap(fn):
            def guarded(path, *args, **kwargs):
                if inside(path):
                    refuse(path)
                return fn(path, *args, **kwargs)

            return guarded

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        for name in ("replace", "rename", "unlink", "remove", "mkdir", "rmdir"):
            monkeypatch.setattr(os, name, wrap(getattr(os, name)))

    return guard


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under root: (mtime, bytes), to show that nothing was written (or rewritten)."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- kill and rerun


def save_generator(root: Path, unet) -> None:
    """root/generator/ in fit-generator's format from a (tiny, random) UNet: diffusers folder +
    a generator manifest pinning its weights' sha256 and root/real/train. Draws nothing."""
    from diffusers import DDPMScheduler

    from core.io import sha256_file
    from models.generators.unet import save_unet
    from shards.manifest import Manifest, manifest_digest, read_manifest, write_manifest

    save_unet(root / "generator", unet, DDPMScheduler(timestep_spacing="trailing"))
    names = read_manifest(root / "real" / "train").class_names
    sha = sha256_file(root / "generator" / "unet" / "diffusion_pytorch_model.safetensors")
    info = {"backend": "unet", "image_size": 16, "class_names": list(names), "weights_sha256": sha}
    upstream = {"real": manifest_digest(root / "real" / "train")}
    manifest = Manifest(
        kind="generator", class_names=names, shards=(), upstream=upstream, info=info
    )
    write_manifest(root / "generator", manifest)


def shards_done(folder: Path, at_least: int):
    """A kill_when condition: `folder` has at least this many complete shards (.done records)."""
    done = Path(folder) / ".done"
    return lambda: done.is_dir() and len(list(done.glob("*.json"))) >= at_least


def kill_when(cmd: list[str], ready, *, cwd=None, env=None, timeout: float = 300.0) -> None:
    """Run `cmd` in its own session and SIGKILL its whole process group (torchrun ranks
    included) the moment `ready()` holds: what an OOM kill or a lost machine leaves behind.
    Fails when the command exits before `ready()` held (the kill would have come too late)."""
    import signal
    import subprocess
    import time

    env = env or (subprocess_env() | {"OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, f"exited (code {proc.returncode}) before the kill point"
            assert time.monotonic() < deadline, f"no kill point within {timeout:.0f} s"
            time.sleep(0.005)
    finally:
        with contextlib.suppress(ProcessLookupError):  # it had exited: the assertion says so
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Killed(BaseException):
    """A kill simulated inside the process. A BaseException, so that no `except Exception` of
    the code under test catches it; nothing after the kill point runs but `finally` blocks."""


class KillPoints:
    """Every file-system change under `root` (a file opened for writing, a rename, a removal,
    a new folder) made while `armed` is one kill point; with `kill_at = n` the n-th one (from 0)
    raises Killed instead of happening (or OSError(ENOSPC) with `full_disk`). `changes` lists the points passed. Writes that bypass
    Python's file API (safetensors, torch.save's zip writer) land between two points."""

    def __init__(self, monkeypatch, root: Path) -> None:
        self.root = str(Path(root).resolve())
        self.armed = False
        self.kill_at: int | None = None
        self.full_disk = False  # raise OSError(ENOSPC) at kill_at instead of Killed
        self.changes: list[str] = []
        real_open = builtins.open

        def point(what: str, path, dir_fd=None) -> None:
            if not self.armed or isinstance(path, int):
                return
            path = os.fspath(path)
            if dir_fd is not None:
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            if not os.path.abspath(path).startswith(self.root):
                return
            if len(self.changes) == self.kill_at:
                if self.full_disk:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                raise Killed(f"killed before {what} {path}")
            self.changes.append(f"{what} {os.path.relpath(path, self.root)}")

        def open_(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                point("write", file)
            return real_open(file, mode, *args, **kwargs)

        def wrap(name: str):
            real = getattr(os, name)

            def changed(path, *args, dir_fd=None, **kwargs):
                point(name, path, dir_fd)
                if dir_fd is not None:
                    kwargs["dir_fd"] = dir_fd
                return real(path, *args, **kwargs)

            return changed

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        for name in ("replace", "rename", "unlink", "remove", "rmdir", "mkdir"):
            monkeypatch.setattr(os, name, wrap(name))


def string_literals(path: Path):
    """(line, text) of each string literal of a module that is no docstring (prose, not a value;
    an f-string's literal parts each): what the vocabulary and preset-name tests scan."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if literal and id(node) not in docstrings:
            yield node.lineno, node.value
