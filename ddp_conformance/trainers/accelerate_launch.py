"""Both processes: `accelerate launch [its flags] train.py ARGS` as a `script:` SPEC's command line.

`accelerate launch` starts the script with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), which the harness gives every rank as torchrun would, plus the
`ACCELERATE_*` variables its flags and the user's accelerate config file set (`--cpu` is
`ACCELERATE_USE_CPU=True`, `--mixed_precision bf16` is `ACCELERATE_MIXED_PRECISION=bf16`...). The
launcher's own arguments are read by accelerate's own parser, and the variables computed by accelerate's
own functions, so the script sees what `accelerate launch` would give it; the launcher's process count and
addresses are the harness's (its `--ddp-world-size`), which the notes say when they differ.
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

LAUNCHER = ("accelerate", "launch")
#: variables the harness sets itself, as torchrun would: never taken from the launcher's environment
_HARNESS_OWN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """`accelerate launch` arguments that accelerate itself refuses, or accelerate not installed."""


def is_launcher(argv: list[str]) -> bool:
    return tuple(argv[:2]) == LAUNCHER


def split(argv: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the launcher's own arguments, the script and its arguments) of `accelerate launch ...`."""
    parsed = _parse(list(argv[2:]))
    script_at = len(argv) - 1 - len(parsed.training_script_args)
    return tuple(argv[2:script_at]), [parsed.training_script, *parsed.training_script_args]


def environment(launcher: tuple[str, ...]) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch` with these arguments gives the script."""
    args = _parse([*launcher, "script.py"])
    try:
        # deferred: accelerate is not a dependency of the plugin, only a line that names its launcher needs it
        from accelerate.commands.launch import _validate_launch_command
        from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
    except ImportError as exc:
        raise LaunchError(f"'accelerate launch' needs accelerate installed in this environment ({exc})") from None
    with _quiet():
        args, _defaults, _mixed = _validate_launch_command(args)
        env = prepare_multi_gpu_env(args) if args.multi_gpu and not args.cpu else (
            prepare_simple_launcher_cmd_env(args)[1])
    return {key: value for key, value in env.items()
            if key.startswith(("ACCELERATE_", "FSDP_")) and key not in _HARNESS_OWN}


def _parse(argv: list[str]) -> Any:
    try:
        # deferred: as in `environment`
        from accelerate.commands.launch import launch_command_parser
    except ImportError as exc:
        raise LaunchError(f"'accelerate launch' needs accelerate installed in this environment ({exc})") from None
    parser = launch_command_parser()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit:
        said = errors.getvalue().strip().splitlines()
        raise LaunchError(f"accelerate launch refuses its arguments: {said[-1] if said else argv}") from None


@contextlib.contextmanager
def _quiet() -> Any:
    """accelerate warns about every default it fills in; the harness runs the launch once per fit."""
    logger = logging.getLogger("accelerate.commands.launch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
