"""`python -m pipeline <stage> --preset NAME [--set key=value ...]` (also `semix ...`).

Every stage is one typed function `stages.<module>.run(config) -> Path`; this file only
parses arguments, resolves the config and calls it. It is also the error boundary: every
expected failure (bad config; missing, corrupt or foreign input; a weights file that is no
safetensors; I/O errors such as a full disk or read-only media) prints as one line naming the
path and the fix, and exits non-zero; set SEMIX_DEBUG=1 for the traceback. Anything else is a
bug: it keeps its traceback, followed by a line asking to report it.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
import traceback
from collections.abc import Sequence

from safetensors import SafetensorError

from core.config import PRESET_NAMES, ConfigError
from core.runtime import setup_logging
from pipeline.registry import STAGES, resolve_stage_config, run_stage, stage_modules

# whole chains, run stage after stage in one process (pipeline/chain.py)
COMMANDS = ("chain", "demo", "study")

EXIT_CONFIG = 2  # bad command line or config: nothing was written
EXIT_DATA = 1  # the stage refused its input or failed cleanly
EXIT_BUG = 3  # an unexpected error: traceback shown, please report it

REPORT = "this is a bug in semix: please report it with the traceback above"

# errno -> what the user can do about it; the message names the path
OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space or set out= to another disk, then rerun "
    "(complete shards are kept)",
    errno.EDQUOT: "the disk quota is exhausted: free space or set out= elsewhere, then rerun",
    errno.EROFS: "the storage is read-only: set out= to a writable folder",
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


def _describe_fields(stage: str) -> str:
    cfg_mod, _ = stage_modules(stage)
    lines = [f"fields of {stage} (--set key=value):"]
    for f in dataclasses.fields(cfg_mod.Config):
        default = f.default if f.default is not dataclasses.MISSING else "?"
        lines.append(f"  {f.name} = {default!r}")
    return "\n".join(lines)


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
        default=[],
        metavar="KEY=VALUE",
        help="override config fields",
    )
    parser.add_argument(
        "--fields", action="store_true", help="list the stage's config fields and exit"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sets = [s for s in args.sets if s]  # Makefile variables expand to empty strings
    try:
        if args.stage in COMMANDS:
            setup_logging(is_main=os.environ.get("RANK", "0") == "0")
            run_command(args.stage, args.preset, sets)
            return 0
        if args.fields:
            print(_describe_fields(args.stage))
            return 0
        if args.print_config:
            import json

            print(
                json.dumps(resolve_stage_config(args.stage, args.preset, sets).to_dict(), indent=2)
            )
            return 0
        setup_logging(is_main=os.environ.get("RANK", "0") == "0")
        out = run_stage(args.stage, args.preset, sets)
        print(f"semix {args.stage}: done -> {out}")
        return 0
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
