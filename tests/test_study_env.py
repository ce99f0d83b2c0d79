"""The study's task commands start their thread pools at the stage's cpu_threads
(pipeline/study/execute.py, task_env)."""

from __future__ import annotations

import sys

import pytest

from pipeline.study.config import Task
from pipeline.study.execute import THREAD_VARS, task_env


@pytest.fixture(autouse=True)
def no_thread_vars(monkeypatch):
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)


def command(stage: str, *sets: str, preset: str = "fashion-mnist") -> list[str]:
    return Task("t", [(stage, list(sets))]).commands(preset)[0]


def test_a_stage_that_pins_its_threads_starts_its_pools_at_that_count():
    assert command("train")[:4] == [sys.executable, "-m", "pipeline", "train"]
    env = task_env(command("train", "run=ce", "seeds=1,2"))
    assert {v: env[v] for v in THREAD_VARS} == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = task_env(command("train", "run=ce", "cpu_threads=3"))
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert task_env(command("evaluate", "cpu_threads=1", "run=ce-s0"))["OMP_NUM_THREADS"] == "1"


def test_torch_default_a_chain_and_the_users_own_value_are_left_alone(monkeypatch):
    # fit-generator keeps torch's default (0: every core); a chain runs stages of several counts
    assert not THREAD_VARS & task_env(command("fit-generator")).keys()
    assert not THREAD_VARS & task_env(command("chain", "name=x")).keys()
    assert not THREAD_VARS & task_env(command("train", "cpu_threads=0")).keys()
    # a misspelt field: the command itself reports it, in its log; the env is left as it is
    assert not THREAD_VARS & task_env(command("train", "no_such_field=1")).keys()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = task_env(command("train"))
    assert env["OMP_NUM_THREADS"] == "2" and "MKL_NUM_THREADS" not in env
