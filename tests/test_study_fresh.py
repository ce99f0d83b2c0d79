"""`make study` on a fresh root: every task that reads data waits for real/ (and the mixed sets
for the chain), what the plan can check is checked before any task starts, and a failed sitting
ends in one short line naming the first cause and the log of every failure."""

import json

import pytest

from core.config import ConfigError
from pipeline.study import resolved, run_study
from pipeline.study.config import METHODS, StudyConfig, StudyError, Task
from pipeline.study.execute import FAILURES, LINE_CHARS, execute, failure_line, last_error
from pipeline.study.plan import plan, setup
from shards.manifest import ShardError


def _ancestors(tasks: dict[str, Task], name: str) -> set[str]:
    seen: set[str] = set()
    todo = list(tasks[name].after)
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += tasks[t].after
    return seen


def test_every_task_of_the_default_study_waits_for_the_data(tmp_path):
    """The whole default plan (every method, tuning, robustness) on a fresh root: real/ is the
    one task without a prerequisite, every other waits for it; every task that trains on a
    mixed set (tuning grids included) waits for that set's chain."""
    tasks = {t.name: t for t in plan(StudyConfig(), "digits", [], tmp_path / "digits")}
    assert [n for n, t in tasks.items() if not t.after] == ["prepare"]
    assert not any(t.done for t in tasks.values())
    for name in tasks:
        if name != "prepare":
            assert "prepare" in _ancestors(tasks, name), name
    tuning = [n for n in tasks if n.startswith("tune-")]
    assert len(tuning) > 20 and all(tasks[n].after for n in tuning)
    makes = {  # mixed folder -> the chain task that makes it
        (tmp_path / s.removeprefix("name=") / "mixed").as_posix(): n
        for n, t in tasks.items() for stage, sets in t.steps if stage == "chain"
        for s in sets if s.startswith("name=")
    }  # fmt: skip
    for name, task in tasks.items():  # a run on a mixed set waits for the chain that makes it
        for stage, sets in task.steps:
            mixed = [s.removeprefix("mixed=") for s in sets if s.startswith("mixed=")]
            if stage == "train" and (mixed or "loss=csm" in sets):
                chain = makes[mixed[0]] if mixed else "chain"
                assert chain in _ancestors(tasks, name), name
    # the generator's cells are tried before set 0 is drawn, every csm-family set after it
    cell_runs = [n for n in tasks if n.startswith("tune-cell-")]
    assert len(cell_runs) == 3 * 3 and set(cell_runs) <= tasks["chain"].after
    cell_order = [n for n in tasks if n.startswith(("chain-cell-", "tune-cell-"))]
    first = ["chain-cell-w1", "tune-cell-w1", "tune-cell-w1-t101", "tune-cell-w1-t102"]
    assert cell_order[:5] == [*first, "chain-cell-w1p5"]  # each cell's chain, then its runs
    assert all("chain" in _ancestors(tasks, n) for n in tasks if n.startswith("chain-m"))
    csm = [n for n in tasks if n.startswith("csm-s") and METHODS["csm"].needs_mixed]
    assert csm and all("chain" in _ancestors(tasks, n) for n in csm)


def test_a_missing_data_folder_stops_the_study_before_any_task(tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(ShardError) as err:  # imagefolder without data_dir, as `make study` does
        setup("imagefolder", [f"out={out}"])
    line = str(err.value)
    assert "\n" not in line and "prepare.data_dir=" in line and "not found" in line
    with pytest.raises(ShardError, match="prepare.data_dir="):
        setup("imagefolder", [f"out={out}", "prepare.data_dir=/nope", "study.methods=ce"])
    assert not out.exists()  # nothing written, nothing started
    # --print-config prints the plan without the data at hand
    assert resolved("imagefolder", [f"out={out}"])["tasks"][0]["name"] == "prepare"


@pytest.mark.parametrize(
    ("preset", "sets", "key"),
    [
        ("digits", ["generate.sample_steps=x"], "generate.sample_steps"),  # a chain step's field
        ("digits", ["prepare.val_fraction=0.9"], "val_fraction"),  # the data task's
        ("digits", ["study.seeds=0", "study.mixed_sets=0"], "mixed_sets"),
        ("digits+nope", [], "nope"),  # a recipe that does not exist
    ],
)
def test_every_config_the_plan_can_check_is_checked_up_front(tmp_path, preset, sets, key):
    out = tmp_path / "runs"
    with pytest.raises((ConfigError, ShardError, ValueError)) as err:
        setup(preset, [f"out={out}", *sets])
    assert key in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


def test_a_failed_sitting_ends_in_one_short_line(tmp_path):
    """Two tasks fail (one by its own error, one because it needs it), one succeeds: the line
    counts them, quotes the first one's own error, and names the log listing all of them."""
    logs = tmp_path / "logs"
    bad = Task("bad", [("prepare", ["source=imagefolder", "data_dir=/nope", f"out={tmp_path}"])])
    needs_bad = Task("needs-bad", [("prepare", [f"out={tmp_path}"])], {"bad"})
    fine = Task("fine", [("prepare", ["--print-config"])], done=True)
    with pytest.raises(StudyError) as err:
        execute([bad, needs_bad, fine], "digits", 2, logs)
    line = str(err.value)
    assert "\n" not in line and len(line) <= LINE_CHARS
    assert line.startswith("2 of 3 study tasks failed; first bad: ")
    assert "image folder '/nope' not found" in line and str(logs / FAILURES) in line
    rows = (logs / FAILURES).read_text().splitlines()
    assert rows[0].startswith("bad: semix prepare: error: image folder") and "bad.log" in rows[0]
    assert rows[1] == "needs-bad: skipped: needs bad"


def test_the_failure_line_cuts_a_long_cause_to_fit(tmp_path):
    log = tmp_path / "chain.log"
    log.write_text("step 1\nsemix chain: error: " + "x" * 2000 + "\n\nTraceback tail\n")
    cause = last_error(log)
    assert cause.startswith("semix chain: error: x")  # the error line, not the last line
    failed = {"chain": cause, **{f"run-{k}": "skipped: needs chain" for k in range(40)}}
    line = failure_line(failed, "chain", 120, tmp_path)
    assert len(line) <= LINE_CHARS and line.startswith("41 of 120 study tasks failed; first chain")
    assert "…" in line and str(tmp_path / FAILURES) in line
    log.write_text("no error line here\nexit without a message\n")
    assert last_error(log) == "exit without a message"


def test_a_study_on_a_fresh_root_runs_end_to_end(tmp_path, tasks_in_process):
    """Nothing prepared: the study makes real/ first, then the shift and OOD sets and the runs
    (which read real/) after it; every record states its labelled images, train and val. Its
    tasks are in-process (tasks_in_process): test_study.py's study starts real ones."""
    sets = [
        f"out={tmp_path}", "study.methods=ce", "study.seeds=0", "study.bootstrap=100",
        "study.tune=false", "study.jobs=1", "train.epochs=1", "train.milestones=",
        "shift.corruptions=gaussian_noise,contrast",  # 2 of 11: nothing here reads which
    ]  # fmt: skip
    report = run_study("digits", sets)
    host = json.loads((report.parent / "host.json").read_text())
    tasks = {"prepare", "shift", "ood", "train-ce", "ce-s0"}  # ce's seeds train as one stack
    assert set(host["task_seconds_this_invocation"]) == tasks
    study = json.loads((report.parent / "study.json").read_text())
    n_val = json.loads((tmp_path / "digits" / "real" / "val" / "manifest.json").read_text())
    (record,) = study["records"]
    assert record["method"] == "ce" and record["seed"] == 0 and record["mixed_set"] is None
    assert record["labelled_images"] == {
        "train": record["labelled_train_images"], "val": n_val["num_samples"]
    }  # fmt: skip
    assert study["labelled_images"] == record["labelled_images"]


def test_a_task_waiting_for_one_outside_the_plan_is_an_error_not_a_silent_skip(tmp_path):
    orphan = Task("orphan", [("prepare", [f"out={tmp_path}"])], {"not-planned"})
    with pytest.raises(StudyError, match=r"outside the plan: \['not-planned'\]"):
        execute([orphan], "digits", 1, tmp_path / "logs")


def test_a_task_whose_preparation_fails_fails_alone(tmp_path):
    """A task's prepare (run in the study's process: a tuning choice, a link) that raises is
    that task's failure, in the same short line; the study does not crash on it."""

    def broken():
        raise OSError(f"{tmp_path}/train/tune-ls-a0p05/metrics.json: no such file")

    task = Task("tune-ls-ext-a", [("train", [f"out={tmp_path}"])], prepare=broken)
    with pytest.raises(StudyError, match=r"^1 of 1 study tasks failed; first tune-ls-ext-a: .*"):
        execute([task], "digits", 1, tmp_path / "logs")
    assert "metrics.json: no such file" in (tmp_path / "logs" / FAILURES).read_text()
    assert "preparing its command failed" in (tmp_path / "logs" / "tune-ls-ext-a.log").read_text()


def test_each_sitting_keeps_its_record_and_the_earlier_ones(tmp_path):
    """host.json is rewritten as each task ends (a sitting cut short says what it did); a later
    invocation keeps every earlier one that ran tasks, and one that ran none adds nothing."""
    from pipeline.study.execute import Sitting

    path = tmp_path / "host.json"
    first = Sitting(path)
    first.write({"prepare": 11.0})  # then the sitting is killed
    cut = json.loads(path.read_text())
    assert cut["task_seconds_this_invocation"] == {"prepare": 11.0} and not cut["finished"]
    second = Sitting(path)
    second.write({"chain": 500.0}, finished=True)
    host = json.loads(path.read_text())
    assert host["finished"] and host["task_seconds_this_invocation"] == {"chain": 500.0}
    assert [e["task_seconds_this_invocation"] for e in host["earlier_invocations"]] == [
        {"prepare": 11.0}
    ]
    Sitting(path).write({}, finished=True)  # a rerun with nothing to do
    Sitting(path).write({}, finished=True)
    assert len(json.loads(path.read_text())["earlier_invocations"]) == 2
