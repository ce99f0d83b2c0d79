"""Several nodes on one machine: generate, annotate, train and evaluate under node agents that
rendezvous like separate machines, and the launches that must fail in one line.

A "node" here is one launcher agent (torchrun --nnodes 2 --nproc_per_node 1, or accelerate launch
--num_machines 2) with its own working folder, TMPDIR and HF_HOME; the runs root is an absolute
path both see (the "shared filesystem"). torchrun uses the c10d rendezvous on 127.0.0.1 (the
agents elect the store host among themselves; --node_rank means nothing there, the rendezvous
orders the nodes), accelerate launch its static one (--machine_rank, --main_process_ip). Each
launch gets a free port and a deadline; the agents and their workers are killed on any failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import REFERENCE_SERIES, subprocess_env

from core.launch import LaunchError, check_launcher, cpu_threads, disagreement
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.manifest import read_manifest

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group("multinode")

# conftest's generated_reference: 24 series of K = 4 in 12 shards (6 per rank)
GENERATE = REFERENCE_SERIES
ANNOTATE = ["batch_size=16", "workers=0"]
TRAIN = ["run=mn", "loss=ce", "epochs=2", "train_limit=256", "batch_size=64"]
DEADLINE = 480  # seconds per launch: minutes on a loaded 2-core machine, ~30 s idle


# ---------------------------------------------------------------- launching nodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(port: int, dirs: list[Path]) -> list[list[str]]:
    """One torchrun agent per node folder; each worker's stdout/stderr goes to the node's
    logs/ (--redirects 3), apart from the agents' own messages."""
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "mn"]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(dirs))]
    logs = [["--log_dir", str(d / "logs"), "--redirects", "3"] for d in dirs]
    return [[*agent, "--nproc_per_node", "1", *rdzv, *log] for log in logs]


def accelerate_nodes(port: int, n: int = 2) -> list[list[str]]:
    """accelerate's torch launcher (--multi_gpu; on a CPU machine semix's ranks use gloo)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    machine = ["--num_machines", str(n), "--num_processes", str(n), "--mixed_precision", "no"]
    master = ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    extra = ["--dynamo_backend", "no"]
    return [[*launch, *machine, "--machine_rank", str(i), *master, *extra] for i in range(n)]


def node_dirs(tmp: Path, n: int = 2) -> list[Path]:
    """Each node's own working folder, temp folder and Hugging Face cache."""
    dirs = [tmp / f"node{i}" for i in range(n)]
    for d in dirs:
        (d / "tmp").mkdir(parents=True, exist_ok=True)
    return dirs


def _kill_tree(proc: subprocess.Popen) -> None:
    """The agent and every worker it started (torchrun puts workers in sessions of their own,
    so a process-group kill would miss them)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [*tree, proc]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            p.send_signal(signal.SIGKILL)
    proc.wait()


@dataclass
class Node:
    rc: int  # the agent's exit code
    out: str  # everything the agent printed (its workers' output too, unless redirected)
    err: str  # the workers' stderr where torchrun redirected it (logs/), else `out`


def launch(launchers: list[list[str]], stage_args: list[str], dirs: list[Path]) -> list[Node]:
    """One agent per node, each running `python -m pipeline <stage_args>`."""
    return launch_each([[*cmd, "-m", "pipeline", *stage_args] for cmd in launchers], dirs)


def launch_each(
    argvs: list[list[str]], dirs: list[Path], extra_env: dict[str, str] | None = None
) -> list[Node]:
    """Start one agent per node (argvs[i] in dirs[i]), wait for all of them (DEADLINE in all);
    on a timeout or an error here every agent and worker is killed before the test fails."""
    procs = []
    with contextlib.ExitStack() as files:
        try:
            for argv, d in zip(argvs, dirs, strict=True):
                env = subprocess_env() | {
                    "OMP_NUM_THREADS": "1",
                    "TMPDIR": str(d / "tmp"),
                    "HF_HOME": str(d / "hf"),
                    **(extra_env or {}),
                }
                # a file, not a pipe: a full pipe would stall a node that nobody reads
                log = files.enter_context(open(d / "stderr.log", "w"))
                procs.append(
                    subprocess.Popen(argv, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
            end = time.monotonic() + DEADLINE
            for p in procs:
                p.wait(timeout=max(1.0, end - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_tree(p)
    nodes = []
    for p, d in zip(procs, dirs):
        out = (d / "stderr.log").read_text()
        workers = sorted(d.glob("logs/**/stderr.log"))
        nodes.append(Node(p.returncode, out, "".join(w.read_text() for w in workers) or out))
    return nodes


def assert_ok(nodes: list[Node], world: int = 2) -> None:
    """Every node succeeded; with `world`, the stage logged (on rank 0 only) that it ran in
    that many processes (world=0: a stage that does not log it)."""
    for node in nodes:
        assert node.rc == 0, (node.out + node.err)[-3000:]
    if world:
        assert sum(f"{world} process(es)" in n.err for n in nodes) == 1, nodes[0].err[-2000:]


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


# ---------------------------------------------------------------- data: real/ + a tiny unet


@pytest.fixture(scope="module")
def src(generator_root) -> Path:
    """runs/digits/ with real/ and a random-weight unet generator/ in fit-generator's format
    (conftest's generator_root, shared with other modules; read-only: tests copy it)."""
    return generator_root


def shared_root(tmp_path: Path, src: Path, *parts: str) -> Path:
    """tmp_path/shared/runs with a copy of the named parts of src: the runs root every node
    reaches by the same absolute path."""
    runs = tmp_path / "shared" / "runs"
    for part in parts:
        shutil.copytree(src / part, runs / "digits" / part)
    return runs


@pytest.fixture(scope="module")
def series_ref(generated_reference) -> Path:
    """series/ of one plain single-process run (the reference every launch must match):
    conftest's generated_reference, GENERATE from src, shared with test_generate."""
    return generated_reference


# ---------------------------------------------------------------- generate


def test_generate_on_two_nodes_is_byte_identical_to_one_process(src, series_ref, tmp_path):
    runs = shared_root(tmp_path, src, "real", "generator")
    dirs = node_dirs(tmp_path)
    nodes = launch(torchrun_nodes(free_port(), dirs), ["generate", "--set", f"out={runs}", *GENERATE], dirs)  # fmt: skip
    assert_ok(nodes)
    assert tree(runs / "digits" / "series") == tree(series_ref)
    # each node wrote shards (6 of 12: shard i -> rank i mod 2); no launch check file is left
    # behind and no file in the nodes' own folders (torchrun keeps empty folders in TMPDIR)
    assert not list(runs.glob("digits/.semix-launch-*"))
    for d in dirs:
        assert sorted(p.name for p in d.iterdir()) == ["logs", "stderr.log", "tmp"]
        assert [p for p in (d / "tmp").rglob("*") if p.is_file()] == []


@pytest.mark.slow
def test_generate_under_accelerate_launch_on_two_machines(src, series_ref, tmp_path):
    runs = shared_root(tmp_path, src, "real", "generator")
    nodes = launch(
        accelerate_nodes(free_port()),
        ["generate", "--set", f"out={runs}", *GENERATE],
        node_dirs(tmp_path),
    )
    assert_ok(nodes)
    assert tree(runs / "digits" / "series") == tree(series_ref)


# stand-ins for SLURM's commands, enough for docs/slurm/semix.sbatch on one machine
SRUN = """#!/bin/bash
# srun --ntasks-per-node=1: the command once per node of the job, all at once
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST (a comma-separated list here)
[[ "$1 $2" == "show hostnames" ]] && tr ',' '\\n' <<< "$3"
"""


@pytest.mark.slow
def test_slurm_script_generates_on_two_nodes(src, series_ref, tmp_path):
    """docs/slurm/semix.sbatch as sbatch would run it on a 2-node job, with srun and scontrol
    stand-ins: its own torchrun line, rendezvous on the first node of the node list."""
    runs = shared_root(tmp_path, src, "real", "generator")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (submit,) = node_dirs(tmp_path / "submit", 1)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1",
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(submit),
        "SEMIX_PYTHON": sys.executable,
        "SEMIX_PORT": str(free_port()),
    }
    script = Path(__file__).resolve().parent.parent / "docs" / "slurm" / "semix.sbatch"
    argv = ["bash", str(script), "generate", "--set", f"out={runs}", *GENERATE]
    (node,) = launch_each([argv], [submit], env)
    assert node.rc == 0, node.out[-3000:]
    assert "2 process(es)" in node.out
    assert tree(runs / "digits" / "series") == tree(series_ref)


# ---------------------------------------------------------------- prepare (rank 0 only)


@pytest.mark.slow
def test_prepare_on_two_nodes_writes_once_as_one_process(digits_root, tmp_path):
    """prepare has no rank split: global rank 0 writes real/, the other node waits for it."""
    runs = tmp_path / "shared" / "runs"
    dirs = node_dirs(tmp_path)
    assert_ok(launch(torchrun_nodes(free_port(), dirs), ["prepare", "--set", f"out={runs}"], dirs), world=0)  # fmt: skip
    assert tree(runs / "digits" / "real") == tree(digits_root / "real")


@pytest.mark.slow
def test_whole_chain_on_two_nodes(digits_root, tmp_path):
    """`make generate`'s chain (prepare -> encoder -> fit-generator -> generate -> annotate) as
    one launch on two nodes, shrunk to seconds per step: prepare writes once (both nodes used
    to write the same shards and trip over each other's temp files) and no node starts a step
    before the previous one's manifest is written."""
    runs = tmp_path / "shared" / "runs"
    dirs = node_dirs(tmp_path)
    small = ["train.epochs=1", "train.train_limit=256", "fit-generator.steps=10"]
    small += ["fit-generator.batch_size=16", "fit-generator.checkpoint_every=5"]
    small += ["fit-generator.samples_per_class=1", "fit-generator.sample_steps=2"]
    small += ["generate.limit=8", "generate.alphas=4", "generate.steps=4", "annotate.batch_size=16"]
    nodes = launch(torchrun_nodes(free_port(), dirs), ["chain", "--set", f"out={runs}", *small], dirs)  # fmt: skip
    assert_ok(nodes, world=0)
    root = runs / "digits"
    assert tree(root / "real") == tree(digits_root / "real")
    for folder in ("real/train", "generator", "series", "mixed"):
        assert (root / folder / "manifest.json").is_file(), folder
    assert read_manifest(root / "mixed").num_samples == 8 * 4
    assert sum(n.err.count("2 process(es)") for n in nodes) == 3  # train, generate, annotate


# ---------------------------------------------------------------- annotate


@pytest.fixture(scope="module")
def annotate_src(src, series_ref, tmp_path_factory) -> Path:
    """runs/digits/ with real/, the reference series/ and a digits-cnn encoder trained by the
    train stage (the annotation space of the digits preset)."""
    out = tmp_path_factory.mktemp("mn-ann-src")
    shutil.copytree(src / "real", out / "digits" / "real")
    shutil.copytree(series_ref, out / "digits" / "series")
    with cpu_threads(1):
        sets = ["run=encoder", "loss=ce", "epochs=1", "train_limit=256", "batch_size=64"]
        run_stage("train", "digits", [f"out={out}", *sets])
    return out / "digits"


@pytest.fixture(scope="module")
def mixed_ref(annotate_src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mn-ann-ref")
    shutil.copytree(annotate_src, out / "digits")
    with cpu_threads(1):
        return run_stage("annotate", "digits", [f"out={out}", *ANNOTATE])


@pytest.mark.slow
def test_annotate_on_two_nodes_is_byte_identical_to_one_process(annotate_src, mixed_ref, tmp_path):
    runs = shared_root(tmp_path, annotate_src, "real", "series", "train")
    dirs = node_dirs(tmp_path)
    assert_ok(launch(torchrun_nodes(free_port(), dirs), ["annotate", "--set", f"out={runs}", *ANNOTATE], dirs))  # fmt: skip
    mixed, ref = tree(runs / "digits" / "mixed"), tree(mixed_ref)
    assert sorted(mixed) == sorted(ref)
    assert [k for k, v in ref.items() if mixed[k] != v] == []


@pytest.mark.slow
def test_a_failing_node_stops_the_other_in_one_line(annotate_src, tmp_path):
    """A corrupt series shard that only rank 1 reads (shard 1): rank 1 names it, rank 0 (done
    with its own shards, waiting for rank 1) says another process stopped; no traceback."""
    runs = shared_root(tmp_path, annotate_src, "real", "series", "train")
    shard = runs / "digits" / "series" / "series-000001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's PNG: same size, another sha256
    shard.write_bytes(data)
    dirs = node_dirs(tmp_path)
    nodes = launch(torchrun_nodes(free_port(), dirs), ["annotate", "--set", f"out={runs}", *ANNOTATE], dirs)  # fmt: skip
    lines = _one_error_line(nodes, "annotate")
    assert sum("series-000001.tar: sha256 mismatch" in line for line in lines) == 1, lines
    assert sum("another process of this launch stopped" in line for line in lines) == 1
    assert not (runs / "digits" / "mixed" / "manifest.json").exists()


# ---------------------------------------------------------------- train and evaluate

TIMING = ("seconds", "images_per_s")


def _history(run_dir: Path) -> list[dict]:
    hist = json.loads((run_dir / "metrics.json").read_text())["train"]["history"]
    return [{k: v for k, v in h.items() if k not in TIMING} for h in hist]


@pytest.mark.slow
def test_train_and_evaluate_on_two_nodes_match_two_processes_on_one_node(src, tmp_path):
    """DDP over two nodes = DDP over two processes of one node (same world, same slices, gloo
    all-reduce of two summands): the weights come out bit for bit equal, hence every metric.
    The two nodes stream their images (each rank decodes its own rows in a DataLoader worker),
    the one node decodes them into memory: the data path changes nothing either."""
    one = shared_root(tmp_path / "one", src, "real")
    two = shared_root(tmp_path / "two", src, "real")
    standalone = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]  # fmt: skip
    assert_ok(launch([standalone], ["train", "--set", f"out={one}", *TRAIN], node_dirs(tmp_path / "one", 1)))  # fmt: skip
    dirs = node_dirs(tmp_path / "two")
    streamed = ["data_path=stream", "stream_workers=1"]
    assert_ok(launch(torchrun_nodes(free_port(), dirs), ["train", "--set", f"out={two}", *TRAIN, *streamed], dirs))  # fmt: skip
    paths = [json.loads((r / "digits" / "train" / "mn" / "host.json").read_text())["data_path"]["path"] for r in (one, two)]  # fmt: skip
    assert paths == ["memory", "stream"]  # auto chose memory for the small set
    a, b = one / "digits" / "train" / "mn", two / "digits" / "train" / "mn"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.json").read_bytes() == (b / "model.json").read_bytes()
    assert _history(a) == _history(b) and len(_history(a)) == 2
    # the machines' facts (data path, seconds) live in host.json: every file the manifest pins,
    # metrics.json included, is the same bytes, hence the manifest itself
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    # evaluate: one process on the first run, two nodes on the second -> the same numbers
    with cpu_threads(1):
        run_stage("evaluate", "digits", [f"out={one}", "run=mn"])
    dirs = node_dirs(tmp_path / "ev")
    nodes = launch(torchrun_nodes(free_port(), dirs), ["evaluate", "--set", f"out={two}", "run=mn"], dirs)  # fmt: skip
    assert all(n.rc == 0 for n in nodes), nodes[0].err[-3000:]
    ea, eb = (tree(r / "digits" / "eval") for r in (one, two))
    assert sorted(ea) == sorted(eb) and "train/mn/predictions.npz" in ea
    assert ea == eb  # the runs have one digest, so their evaluations are the same bytes


# ---------------------------------------------------------------- launches that must fail


def _one_error_line(nodes: list[Node], stage: str) -> list[str]:
    """Every node exits non-zero; each worker printed exactly one `semix <stage>: error:` line
    and no traceback (the agents' own messages aside)."""
    lines = []
    for node in nodes:
        mine = [ln for ln in node.err.splitlines() if ln.startswith(f"semix {stage}: error:")]
        assert node.rc != 0 and len(mine) == 1 and "Traceback" not in node.err, node.err[-3000:]
        lines += mine
    return lines


def test_nodes_with_different_config_fail_in_one_line(src, tmp_path):
    runs = shared_root(tmp_path, src, "real", "generator")
    dirs = node_dirs(tmp_path)
    stage = ["-m", "pipeline", "generate", "--set", f"out={runs}", *GENERATE]
    first, second = torchrun_nodes(free_port(), dirs)
    # the second node was started with another seed and another step count
    nodes = launch_each([[*first, *stage], [*second, *stage, "seed=1", "steps=5"]], dirs)
    for line in _one_error_line(nodes, "generate"):
        assert "disagree on the config" in line
        assert "rank(s) 1 " in line and "in seed, steps (" in line, line
    assert not (runs / "digits" / "series").exists()  # refused before anything was written


@pytest.mark.slow
def test_output_not_on_a_shared_folder_fails_in_one_line(src, tmp_path):
    """out=runs (relative) resolves to each node's own working folder: rank 0 would wait for
    shards that the other node wrote elsewhere; refused at the start, naming both folders."""
    dirs = node_dirs(tmp_path)
    for d in dirs:  # each node has the inputs, but in its own folder
        shutil.copytree(src, d / "runs" / "digits")
    nodes = launch(torchrun_nodes(free_port(), dirs), ["generate", "--set", "out=runs", *GENERATE], dirs)  # fmt: skip
    for line in _one_error_line(nodes, "generate"):
        assert "do not see the files rank 0" in line and "filesystem every node mounts" in line
        assert all(str(d / "runs" / "digits") in line for d in dirs), line
    for d in dirs:
        assert not (d / "runs" / "digits" / "series").exists()
        assert not list((d / "runs").glob("digits/.semix-launch-*"))


# ---------------------------------------------------------------- in one process


def test_ranks_disagreeing_are_named_with_their_fields():
    """What check_same raises, from what every rank sent (three ranks here)."""
    sent = [
        {"host": "a", "fields": {"seed": 0, "steps": 6, "model": "m"}},
        {"host": "b", "fields": {"seed": 0, "steps": 6, "model": "m"}},
        {"host": "c", "fields": {"seed": 1, "steps": 6, "model": "m", "extra": 1}},
    ]
    msg = disagreement(sent, "the config")
    assert "\n" not in msg and "rank(s) 2 (on c)" in msg and "rank 0 (on a)" in msg
    assert "in extra, seed" in msg and "seed = 0 on rank 0, 1 on rank 2" in msg
    assert "steps" not in msg and "rank(s) 1" not in msg
    assert disagreement([sent[0], sent[1], sent[0]], "the config") is None


def test_unranked_accelerate_process_is_refused(monkeypatch, capsys, tmp_path):
    """`accelerate launch --cpu --num_machines 2` (no mpirun) starts one unranked process per
    machine, each of which would do the whole job: refused in one line, before any work."""
    for var in ("WORLD_SIZE", "RANK", "PMI_SIZE", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    check_launcher()  # a plain process is fine
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    with pytest.raises(LaunchError, match="gave it no rank"):
        check_launcher()
    code = main(["prepare", "--preset", "digits", "--set", f"out={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "torchrun --nnodes N" in err
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_launcher()  # ranked: accelerate's torch launcher or torchrun
    assert os.environ["RANK"] == "0"
