"""`python -m pipeline <stage> --preset NAME [--set key=value ...]` (also `semix ...`).

Every stage is one typed function `stages.<module>.run(config) -> Path`; this file only
parses arguments, resolves the config and calls it. It is also the error boundary: every
expected failure (bad config; missing, corrupt or foreign input; a weights file that is no
safetensors; I/O errors such as a full disk or read-only media) prints as one line naming the
path and the fix, and exits non-zero; set SEMIX_DEBUG=1 for the traceback. A full disk, an
exhausted quota or read-only media (the writers name the file: core.io.writing) and Ctrl-C
(exit 130) say that completed work is kept and a rerun resumes: no stage marks anything
complete before its last write (docs/faults.md). Anything else is a bug: it keeps its
traceback, followed by a line asking to report it.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from safetensors import SafetensorError

from core.config import ConfigError, RenamedField, did_you_mean, every_field
from core.environment import check_environment
from core.logs import log, setup_logging
from pipeline.plugins import load_plugins
from pipeline.registry import STAGES, describe_stage, resolve_stage_config, run_stage
from pipeline.usage import COMMANDS, help_text, overview
from stages import presets
from stages.presets import DEFAULT as DEFAULT_PRESET
from stages.presets import compose

EXIT_CONFIG = 2  # bad command line or config: nothing was written
EXIT_DATA = 1  # the stage refused its input or failed cleanly
EXIT_BUG = 3  # an unexpected error: traceback shown, please report it
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it

REPORT = "this is a bug in semix: please report it with the traceback above"
INTERRUPTED = "interrupted; completed work is kept, rerun the same command to resume"
KEPT = "completed work is kept"
# another out= is another command, which starts over: say so, not "rerun the same command"
ELSEWHERE = "(or set out= to {where} and start over there)"

# errno -> what the user can do about it; the message names the path
OS_HINTS = {
    errno.ENOSPC: f"the disk is full; {KEPT}: free space and rerun the same command to resume "
    + ELSEWHERE.format(where="another disk"),
    errno.EDQUOT: f"the disk quota is exhausted (the disk is full for this user); {KEPT}: free "
    "space and rerun the same command to resume " + ELSEWHERE.format(where="another disk"),
    errno.EROFS: f"the storage is read-only; {KEPT}: restore write access and rerun the same "
    "command to resume " + ELSEWHERE.format(where="a writable folder"),
    errno.EACCES: "permission denied: check the file's permissions or set out= elsewhere",
    errno.EPERM: "operation not permitted: check permissions or set out= elsewhere",
    errno.ENOTDIR: "a part of this path is a file, not a folder: check out= and the input paths",
    errno.EISDIR: "this is a folder where a file was expected: check the path",
    errno.ENOENT: "no such file or folder: check the path, or run the stage that writes it",
    errno.EIO: "the storage reported an I/O error: check the disk, then rerun",
}


def run_command(command: str, preset: str, sets: Sequence[str]) -> None:
    """chain / demo / study: whole runs of several stages (imported here, on demand)."""
    if command == "chain":
        from pipeline.chain import chain

        chain(preset, sets)
    elif command == "demo":
        from pipeline.demo import run_demo

        run_demo(preset, sets)
    else:
        from pipeline.study import main as study

        study(preset, sets)


def describe(command: str, preset: str, sets: Sequence[str], print_config: bool) -> str:
    """--fields (every field: default, the preset's value, description) or --print-config (the
    resolved config) of a stage or a command. Starts no work and writes nothing."""
    if command in COMMANDS:
        module = importlib.import_module(COMMANDS[command])
        if print_config:
            return json.dumps(module.resolved(preset, sets), indent=2)
        return module.fields_text(preset)
    if print_config:  # every field, as --fields lists them (config.json, recorded(), skips some)
        return json.dumps(every_field(resolve_stage_config(command, preset, sets)), indent=2)
    return describe_stage(command, preset)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line like every other semix error (not the usage block
    and a second line), and a guess for a misspelt option."""

    def error(self, message: str) -> NoReturn:
        wrong = re.search(r"unrecognized arguments: (-\S+)", message)
        options = [o for action in self._actions for o in action.option_strings]
        guess = did_you_mean(wrong.group(1), options) if wrong else ""
        print(f"semix: error: {message}; {guess}semix --help lists the options", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="semix",
        description="Calibration-aware semantic mixing: data that teaches classifiers when to be "
        "unsure.",
        usage="semix STAGE [--preset NAME] [--set KEY=VALUE ...] [--fields | --print-config | "
        "--estimate | --help]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help is ours: `semix <stage> --help` describes that stage
    )
    # not argparse's choices: its error is two lines without a guess (check_name has one)
    parser.add_argument("stage", nargs="?", metavar="STAGE", help=f"one of: {', '.join(names())}")
    parser.add_argument(
        "--preset",
        metavar="NAME",
        default=None,  # None: not given, which the log says (DEFAULT_PRESET is used)
        help=f"{', '.join(presets.NAMES)}, or a classes .txt file (default: {DEFAULT_PRESET})",
    )
    # a recipe apart from the data: `--preset DATA --recipe NAME` is the preset DATA+NAME
    # (stages/presets), which is what the chain's and the study's commands pass on; not a config
    # field, so no config.json of a run without a recipe changes
    parser.add_argument(
        "--recipe",
        metavar="NAME",
        default=None,
        help="a preset whose recipe (every value but the data source) runs on --preset's data; "
        "its run root is <preset>+<recipe>",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        nargs="*",
        action="extend",  # `--set a=1 --set b=2` is `--set a=1 b=2`; a later value of a key wins
        default=[],
        metavar="KEY=VALUE",
        help="override config fields (repeatable; chain/demo: <stage>.key=value, study: also "
        "study.key=value)",
    )
    parser.add_argument(
        "--fields",
        action="store_true",
        help="list the fields (default, the preset's value, description) and exit: runs nothing",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (every field) and exit: runs nothing",
    )
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="study only: print the plan's expected wall on this machine and exit: runs nothing",
    )
    parser.add_argument(
        "-h",
        "--help",
        action="store_true",
        help="show this help; `semix STAGE --help`: the stage's fields, presets and examples",
    )
    return parser


def names() -> tuple[str, ...]:
    """What `semix NAME` runs: a stage, or a command (COMMANDS: whole chains, stage after stage
    in one process; each module has `fields_text(preset)` and `resolved(preset, sets)` for
    --fields and --print-config). Read when asked: a plugin's stages are among them."""
    return (*STAGES, *COMMANDS)


def check_name(name: str | None) -> None:
    if name is None:
        raise ConfigError("name a stage or command; semix --help lists them")
    if name not in names():
        raise ConfigError(
            f"unknown stage or command {name!r}; {did_you_mean(name, names())}choose one of: "
            f"{', '.join(names())}"
        )


def show(text: str) -> int:
    """Print `text` (exit 0). A reader that has gone (`semix train --fields | head -1`) ends
    it quietly: what it read is all it wanted."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # stdout to /dev/null: the interpreter's last flush at exit would hit the pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _warnings_of(who: str) -> Callable[..., str]:
    """How warnings are printed: a renamed --set spelling as one line, its message after `who`
    (`semix train: lr is now optim.lr`); other warnings as Python says."""

    def format_warning(message, category, *args, **kwargs) -> str:
        if issubclass(category, RenamedField):
            return f"{who}: {message}\n"
        return _python_format(message, category, *args, **kwargs)

    return format_warning


_python_format = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _warnings_of("semix")
    try:  # first: a plugin's loss, preset or stage is in every config and help (plugins.py)
        load_plugins()
    except ConfigError as e:
        return _fail("semix", str(e), EXIT_CONFIG, e)
    parser = build_parser()
    args = parser.parse_args(argv)
    sets = [s for s in args.sets if s]  # Makefile variables expand to empty strings
    is_main = os.environ.get("RANK", "0") == "0"  # under a launcher: global rank 0
    who = f"semix {args.stage}" if args.stage in names() else "semix"  # how its lines start
    warnings.formatwarning = _warnings_of(who)
    try:
        if args.help and args.stage is None:
            parser.epilog = overview()
            return show(parser.format_help().rstrip())
        check_name(args.stage)
        preset = compose(args.preset or DEFAULT_PRESET, args.recipe)  # an unknown recipe: here
        if args.help:
            return show(help_text(args.stage, preset))
        if args.estimate and args.stage != "study":
            raise ConfigError(
                f"--estimate is the study's (semix study --estimate), not {args.stage}'s"
            )
        if args.estimate and not (args.fields or args.print_config):  # runs nothing
            from pipeline.study import estimate_text

            return show(estimate_text(preset, sets))  # --print-config's plan holds it already
        if args.fields or args.print_config:  # on every command: describe, never start work
            return show(describe(args.stage, preset, sets, print_config=not args.fields))
        check_environment()  # before any work: a value semix would misread is one line
        setup_logging(is_main=is_main)
        if args.preset is None:
            log.info("no --preset: using %s", DEFAULT_PRESET)
        if args.stage in COMMANDS:
            run_command(args.stage, preset, sets)
            return 0
        out = run_stage(args.stage, preset, sets)
        return show(f"semix {args.stage}: done -> {out}") if is_main else 0  # one line per run
    except KeyboardInterrupt:  # Ctrl-C anywhere: nothing is marked complete before its end
        if os.environ.get("SEMIX_DEBUG") == "1":
            raise
        if is_main:  # every rank got it; one line says it
            print(f"{who}: {INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as e:
        return _fail(who, str(e), EXIT_CONFIG, e)
    except OSError as e:  # I/O: full disk, read-only media, a file where a folder should be, ...
        return _fail(who, describe_os_error(e), EXIT_DATA, e)
    except ValueError as e:  # bad or corrupt input (ShardError and the stages' own errors)
        return _fail(who, str(e), EXIT_DATA, e)
    except SafetensorError as e:  # the readers name the file; this is the last resort
        return _fail(who, f"a weights file is not valid safetensors ({e})", EXIT_DATA, e)
    except Exception:
        traceback.print_exc()
        print(f"{who}: internal error: {REPORT}", file=sys.stderr)
        return EXIT_BUG


def describe_os_error(e: OSError) -> str:
    """One line: what failed, on which path, and what to do about it."""
    what = e.strerror or str(e) or type(e).__name__
    path = f": {e.filename}" if e.filename else ""
    if e.filename2:
        path += f" -> {e.filename2}"
    hint = OS_HINTS.get(e.errno or 0)
    if not e.strerror:  # e.g. PIL's "broken data stream" or diffusers' loading errors
        return what
    return f"{what}{path}" + (f"; {hint}" if hint else "")


def _fail(who: str, message: str, code: int, error: Exception) -> int:
    """One line, `semix <stage>: error: ...` (`semix: error: ...` before a stage is known)."""
    if os.environ.get("SEMIX_DEBUG") == "1":
        raise error
    message = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    print(f"{who}: error: {message}", file=sys.stderr)
    return code
