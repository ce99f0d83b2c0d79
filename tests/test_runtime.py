"""core/logs and core/version: progress (tqdm bars on a terminal, plain log lines elsewhere,
log lines never inside a bar) and the code version every manifest records."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from core import __version__
from core.logs import LogProgress, log, progress, setup_logging
from core.version import code_version

STAMP = re.compile(r"^\d\d:\d\d:\d\d semix ")


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as a console's stderr does."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def shown(monkeypatch):
    """Progress as a user sees it: semix's logging on, SEMIX_NO_PROGRESS (set for the test
    session by conftest) and SEMIX_PROGRESS unset."""
    monkeypatch.delenv("SEMIX_NO_PROGRESS", raising=False)
    monkeypatch.delenv("SEMIX_PROGRESS", raising=False)
    monkeypatch.delenv("SEMIX_PROGRESS_EVERY", raising=False)
    setup_logging()


def messages(text: str) -> list[str]:
    """The log messages of captured stderr, without their time stamps."""
    return [STAMP.sub("", line) for line in text.splitlines() if STAMP.match(line)]


def test_stderr_that_is_no_terminal_gets_log_lines_and_no_bar_frames(shown, capsys):
    """stderr redirected to a file: no carriage return anywhere, and a stage's own log line on a
    line of its own; a loop done within PROGRESS_GAP_S (30 s) logs only its last line, at
    close (the 10 % steps with a clock: the test below)."""
    with progress(range(40), desc="generate", unit="img") as bar:
        assert isinstance(bar, LogProgress)
        for _ in bar:  # 1..40 in well under 30 s: no line until the end
            pass
        log.info("generate: a line of the stage")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = messages(err)
    steps = [m.split(" (")[0] for m in lines if m.startswith("generate: ") and "%" in m]
    assert steps == ["generate: 40/40 img"]
    assert lines[-1] == "generate: 40/40 img (100 %)"  # written at close, after the stage's
    assert "generate: a line of the stage" in lines


def test_log_lines_give_rate_and_time_left_every_10_percent_and_every_n_seconds(shown, capsys):
    """A fake clock: the 10 % steps and the `every` seconds both make a line; the rate is over
    the time since the line before, the time left follows from it; a skip ahead (complete
    shards of a resumed stage) has no rate; set_postfix joins the line."""
    now = [0.0]
    bar = LogProgress(
        None, total=720, desc="generate", unit="series", every=60, clock=lambda: now[0]
    )
    now[0] = 40.0
    bar.update(120)  # 16 %: crosses 10 %
    now[0] = 70.0
    bar.update(24)  # 20 %: crosses 20 %; 24 series in 30 s
    now[0] = 100.0
    bar.update(6)  # 20 %, 30 s after the last line: no line
    now[0] = 140.0
    bar.update(4)  # 21 %, 70 s after the last line: a line (10 series in 70 s)
    bar.set_postfix(loss="0.1234")
    bar.update(566)  # the rest at once (0 s): 100 %, no rate
    bar.close()  # 720 was shown: nothing more
    assert messages(capsys.readouterr().err) == [
        "generate: 120/720 series (16 %), 3 series/s, ~3 min left",
        "generate: 144/720 series (20 %), 0.8 series/s, ~12 min left",
        "generate: 154/720 series (21 %), 0.143 series/s, ~66 min left",
        "generate: 720/720 series (100 %), loss 0.1234",
    ]
    # work that ends between two lines gets its last line at close
    now[0] = 0.0
    bar = LogProgress(None, total=None, desc="study", unit="run", every=60, clock=lambda: now[0])
    now[0] = 2.0
    bar.update(3)
    bar.close()
    assert messages(capsys.readouterr().err) == ["study: 3 run, 1.5 run/s"]


def test_a_caller_that_says_its_own_time_left_gets_no_count_extrapolation(
    shown, capsys, monkeypatch
):
    """progress(eta=False), the study's: its tasks differ in cost, so the count's runs per
    second would misprice what is left; the line shows the caller's postfix (set_postfix_str,
    tqdm's name) instead, and a terminal's bar has no `<remaining` either."""
    now = [0.0]
    bar = LogProgress(
        None, total=10, desc="study", unit="run", every=60, clock=lambda: now[0], eta=False
    )
    now[0] = 40.0
    bar.set_postfix_str("~3 h 10 min left (the estimate's rates)")
    bar.update(2)  # 20 %: a line, 2 runs in 40 s, no "~2.7 min left" from the count
    assert messages(capsys.readouterr().err) == [
        "study: 2/10 run (20 %), 0.05 run/s, ~3 h 10 min left (the estimate's rates)"
    ]
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress(range(10), desc="study", unit="run", eta=False) as bar:
        bar.set_postfix_str("~5 min left")
        bar.update(3)
    assert "~5 min left" in terminal.getvalue() and "<" not in terminal.getvalue()
    counted = Terminal()
    monkeypatch.setattr(sys, "stderr", counted)
    with progress(range(10), desc="study", unit="run") as bar:  # the default: tqdm's own
        bar.update(3)
    assert "<" in counted.getvalue()


def test_terminal_gets_a_bar_and_log_lines_never_share_its_line(shown, monkeypatch):
    """On a terminal a tqdm bar redraws its line with carriage returns; a log line written while
    the bar is up clears the bar first, stands on a line of its own, and the bar comes back."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress(range(30), desc="annotate", unit="img") as bar:
        assert not isinstance(bar, LogProgress)
        bar.update(10)
        log.info("annotate: a line of the stage")
        bar.update(20)
    text = terminal.getvalue()
    assert "\r" in text and "annotate: 100%" in text  # the bar's frames
    # what a terminal shows of each line: the text after its last carriage return
    visible = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    logged = [v for v in visible if "a line of the stage" in v]
    assert len(logged) == 1 and STAMP.sub("", logged[0]) == "annotate: a line of the stage"
    # the switches: log lines on a terminal too, or nothing at all
    monkeypatch.setenv("SEMIX_PROGRESS", "log")
    assert isinstance(progress(range(3), desc="x"), LogProgress)
    monkeypatch.setenv("SEMIX_PROGRESS", "off")
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    with progress(range(3), desc="x") as bar:
        bar.update(3)
    assert quiet.getvalue() == ""
    monkeypatch.setenv("SEMIX_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match="SEMIX_PROGRESS='sometimes': choose one of"):
        progress(range(3), desc="x")


def test_code_version_names_the_commit_of_this_checkout():
    """The commit of the checkout semix runs from, never of a repository around it."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert code_version() == f"{__version__}+g{head}"
