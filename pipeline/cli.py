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
import sys
import traceback
from collections.abc import Sequence

from safetensors import SafetensorError

from core.config import PRESET_NAMES, ConfigError
from core.logs import setup_logging
from pipeline.registry import STAGES, describe_stage, resolve_stage_config, run_stage

# whole chains, run stage after stage in one process: command -> its module, which has
# `fields_text(preset)` and `resolved(preset, sets)` for --fields and --print-config
COMMANDS = {"chain": "pipeline.chain", "demo": "pipeline.demo", "study": "pipeline.study"}

EXIT_CONFIG = 2  # bad command line or config: nothing was written
EXIT_DATA = 1  # the stage refused its input or failed cleanly
EXIT_BUG = 3  # an unexpected error: traceback shown, please report it
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it

REPORT = "this is a bug in semix: please report it with the traceback above"
INTERRUPTED = "interrupted; completed work is kept, rerun the same command to resume"
KEPT = "completed work is kept"

# errno -> what the user can do about it; the message names the path
OS_HINTS = {
    errno.ENOSPC: f"the disk is full; {KEPT}: free space (or set out= to another disk) and "
    "rerun the same command to resume",
    errno.EDQUOT: f"the disk quota is exhausted (the disk is full for this user); {KEPT}: free "
    "space (or set out= elsewhere) and rerun the same command to resume",
    errno.EROFS: f"the storage is read-only; {KEPT}: restore write access (or set out= to a "
    "writable folder) and rerun the same command to resume",
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
    if print_config:
        return json.dumps(resolve_stage_config(command, preset, sets).to_dict(), indent=2)
    return describe_stage(command, preset)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="semix",
        description="Calibration-aware semantic mixing: data that teaches classifiers when to be unsure.",
    )
    parser.add_argument(
        "stage",
        choices=[*STAGES, *COMMANDS],
        metavar="STAGE",
        help=f"one of: {', '.join([*STAGES, *COMMANDS])}",
    )
    parser.add_argument(
        "--preset", default="digits", help=f"{', '.join(PRESET_NAMES)}, or a classes .txt file"
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
        help="print the resolved config and exit: runs nothing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sets = [s for s in args.sets if s]  # Makefile variables expand to empty strings
    try:
        if args.fields or args.print_config:  # on every command: describe, never start work
            print(describe(args.stage, args.preset, sets, print_config=not args.fields))
            return 0
        setup_logging(is_main=os.environ.get("RANK", "0") == "0")
        if args.stage in COMMANDS:
            run_command(args.stage, args.preset, sets)
            return 0
        out = run_stage(args.stage, args.preset, sets)
        print(f"semix {args.stage}: done -> {out}")
        return 0
    except KeyboardInterrupt:  # Ctrl-C anywhere: nothing is marked complete before its end
        if os.environ.get("SEMIX_DEBUG") == "1":
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank got it; one line says it
            print(f"semix {args.stage}: {INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as e:
        return _fail(args.stage, str(e), EXIT_CONFIG, e)
    except OSError as e:  # I/O: full disk, read-only media, a file where a folder should be, ...
        return _fail(args.stage, describe_os_error(e), EXIT_DATA, e)
    except ValueError as e:  # bad or corrupt input (ShardError and the stages' own errors)
        return _fail(args.stage, str(e), EXIT_DATA, e)
    except SafetensorError as e:  # the readers name the file; this is the last resort
        return _fail(args.stage, f"a weights file is not valid safetensors ({e})", EXIT_DATA, e)
    except Exception:
        traceback.print_exc()
        print(f"semix {args.stage}: internal error: {REPORT}", file=sys.stderr)
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


def _fail(stage: str, message: str, code: int, error: Exception) -> int:
    if os.environ.get("SEMIX_DEBUG") == "1":
        raise error
    message = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    print(f"semix {stage}: error: {message}", file=sys.stderr)
    return code
