"""`python -m pipeline <stage> --preset NAME [--set key=value ...]` (also `semix ...`).

Every stage is one typed function `stages.<module>.run(config) -> Path`; this file only
parses arguments, resolves the config and calls it. Errors that are the user's to fix
(bad config, missing or corrupt input) print as one line and exit non-zero; set
SEMIX_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence

from pipeline.config import PRESET_NAMES, ConfigError, resolve
from pipeline.runtime import cpu_threads, setup_logging

# stage name on the command line -> module under pipeline/configs/ and stages/
STAGES = {
    "prepare": "prepare",
    "fit-generator": "fit_generator",
    "generate": "generate",
    "annotate": "annotate",
    "train": "train",
    "evaluate": "evaluate",
    "finetune": "finetune",
    "publish": "publish",
    "pull": "pull",
    "convert-edm": "convert_edm",
}
# whole chains, run stage after stage in one process (pipeline/chain.py)
COMMANDS = ("chain", "demo")

EXIT_CONFIG = 2  # bad command line or config: nothing was written
EXIT_DATA = 1  # the stage refused its input or failed cleanly


def stage_modules(stage: str):
    """(config module, stage module) for a stage name."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    mod = STAGES[stage]
    try:
        cfg_mod = importlib.import_module(f"pipeline.configs.{mod}")
        run_mod = importlib.import_module(f"stages.{mod}")
    except ModuleNotFoundError as e:
        if e.name in (f"pipeline.configs.{mod}", f"stages.{mod}"):
            raise ConfigError(f"stage {stage!r} is not available in this version of semix") from e
        raise
    return cfg_mod, run_mod


def resolve_stage_config(stage: str, preset: str, sets: Sequence[str] = ()):
    cfg_mod, _ = stage_modules(stage)
    return resolve(cfg_mod.Config, cfg_mod.PRESETS, preset, sets)


def run_stage(stage: str, preset: str, sets: Sequence[str] = ()):
    cfg_mod, run_mod = stage_modules(stage)
    config = resolve(cfg_mod.Config, cfg_mod.PRESETS, preset, sets)
    with cpu_threads(config.cpu_threads):
        return run_mod.run(config)


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
            from pipeline import chain

            setup_logging(is_main=True)
            getattr(chain, args.stage)(args.preset, sets)
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
        return _fail(args.stage, e, EXIT_CONFIG)
    except (ValueError, FileNotFoundError, PermissionError) as e:
        return _fail(args.stage, e, EXIT_DATA)


def _fail(stage: str, error: Exception, code: int) -> int:
    if os.environ.get("SEMIX_DEBUG") == "1":
        raise error
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"semix {stage}: error: {message}", file=sys.stderr)
    return code
