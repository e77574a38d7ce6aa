"""Both processes: command-line and ini options of the plugin, and their validation.

Every option has an ini mirror so a repo can pin its settings in one line of pytest config; the
command line wins. Bad values become one-line usage errors here, before anything is spawned.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .config import ConfigError, RunConfig, load_config
from .runner.controller import RunnerSettings
from .runner.wire import WARMUP
from .selection import DEFAULT_CHECKS, OPT_IN, parse_checks

if TYPE_CHECKING:
    from .trainers.spec import TrainerSpec

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT = 120.0


@dataclass(frozen=True)
class Settings:
    """The validated options of one pytest session."""

    world_size: int
    backend: str
    timeout: float
    start_timeout: float
    rank_threads: int | None
    device: str = "auto"
    trainers: tuple[str, ...] = ("torch", "lightning")
    config_path: str | None = None
    report_path: str | None = None
    checks: tuple[str, ...] = DEFAULT_CHECKS  # the conformance checks the suite runs, in suite order
    advise: bool = False  # measure what a setting the config leaves off would give (`--ddp-advise`)
    max_steps: int | None = None  # the most optimizer steps one fit of a check may train (`--ddp-max-steps`)
    spec_base: str = "."  # what relative SPEC paths are relative to: the typist's directory, or the rootdir for ini

    @property
    def runner(self) -> RunnerSettings:
        """The options the runner acts on, as its own input type (the runner imports nothing above it)."""
        return RunnerSettings(backend=self.backend, timeout=self.timeout, start_timeout=self.start_timeout,
                              rank_threads=self.rank_threads, device=self.device)


SETTINGS_KEY = pytest.StashKey[Settings]()


def settings_of(config: pytest.Config) -> Settings:
    """The session's validated options (world size, trainer SPECs, config path...), read once in
    `pytest_configure`."""
    return config.stash[SETTINGS_KEY]


TRAINERS_KEY = pytest.StashKey["tuple[TrainerSpec, ...]"]()
RUN_CONFIG_KEY = pytest.StashKey[RunConfig]()


def session_trainers(config: pytest.Config) -> tuple[TrainerSpec, ...]:
    """The session's SPECs, each parsed once with its session label: what the validation resolves,
    and what the suite is parametrized by and sends to the ranks."""
    if TRAINERS_KEY not in config.stash:
        # deferred: the SPEC module's imports (unittest.mock brings asyncio) would slow every pytest start
        from .trainers.spec import session_trainers as parse_all

        settings = settings_of(config)
        config.stash[TRAINERS_KEY] = parse_all(settings.trainers, settings.spec_base)
    return config.stash[TRAINERS_KEY]


def run_config(config: pytest.Config) -> RunConfig:
    """`--ddp-config`, read once for the session (defaults without one)."""
    if RUN_CONFIG_KEY not in config.stash:
        config.stash[RUN_CONFIG_KEY] = load_config(settings_of(config).config_path)
    return config.stash[RUN_CONFIG_KEY]


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddp-conformance", "ddp-conformance (distributed DDP tests and conformance checks)")
    group.addoption(
        "--ddp-world-size", dest="ddp_world_size", default=None, metavar="N",
        help=f"number of ranks of a distributed test (int >= 1; default {DEFAULT_WORLD_SIZE}).",
    )
    group.addoption(
        "--ddp-backend", dest="ddp_backend", default=None, metavar="{auto,gloo,nccl}",
        help="process-group backend; auto picks nccl when CUDA has at least N GPUs, else gloo.",
    )
    group.addoption(
        "--ddp-device", dest="ddp_device", default=None, metavar="{auto,cpu,cuda}",
        help="where ranks work: auto (GPUs under nccl, the CPU under gloo), cpu, or cuda (GPUs under gloo too, "
        "shared when there are fewer GPUs than ranks).",
    )
    group.addoption(
        "--ddp-timeout", dest="ddp_timeout", default=None, metavar="SECONDS",
        help=f"wall-clock limit of one distributed test (default {DEFAULT_TIMEOUT:g}).",
    )
    group.addoption(
        "--ddp-start-timeout", dest="ddp_start_timeout", default=None, metavar="SECONDS",
        help="limit for a pool's ranks to start and meet (default: the larger of --ddp-timeout and 60).",
    )
    group.addoption(
        "--ddp-rank-threads", dest="ddp_rank_threads", default=None, metavar="N",
        help="intra-op threads per rank (default: OMP_NUM_THREADS if set, else 1, as torchrun does).",
    )
    group.addoption(
        "--ddp-trainer", dest="ddp_trainers", action="append", default=None, metavar="SPEC",
        help="trainer to check (repeatable): torch, lightning, package.module:Attr or path/file.py:Attr (an "
        "adapter), lightning:pkg.module:LitModule[+pkg.module:LitDataModule] (no adapter); default both built-ins.",
    )
    group.addoption(
        "--ddp-checks", dest="ddp_checks", default=None, metavar="CHECKS",
        help="the conformance checks to run, comma-separated: check ids, default (every check but "
        f"{', '.join(OPT_IN)}) and all; default: default.",
    )
    group.addoption(
        "--ddp-advise", dest="ddp_advise", action="store_true", default=None,
        help="where the config leaves a setting off, also measure what turning it on would give "
        "(bucket_view_memory's saving, whether static_graph could be on): more fits.",
    )
    group.addoption(
        "--ddp-max-steps", dest="ddp_max_steps", default=None, metavar="N",
        help="the most optimizer steps any one fit of a conformance check may train; a check whose plan needs "
        "more skips, saying what it needs (default: no cap).",
    )
    group.addoption(
        "--ddp-config", dest="ddp_config", default=None, metavar="PATH",
        help="Lightning-style YAML run config (trainer.strategy, trainer.precision, ...; see docs/adapter.md).",
    )
    group.addoption(
        "--ddp-report", dest="ddp_report", default=None, metavar="PATH",
        help="write the conformance results as JSON to PATH.",
    )
    parser.addini("ddp_trainers", "default --ddp-trainer SPECs, one a line", type="linelist", default=[])
    parser.addini("ddp_checks", "default --ddp-checks", default=None)
    parser.addini("ddp_advise", "default --ddp-advise", type="bool", default=False)
    parser.addini("ddp_max_steps", "default --ddp-max-steps", default=None)
    parser.addini("ddp_config", "default --ddp-config (relative to the rootdir)", default=None)
    parser.addini("ddp_report", "default --ddp-report (relative to the rootdir)", default=None)
    parser.addini("ddp_world_size", "default --ddp-world-size", default=None)
    parser.addini("ddp_backend", "default --ddp-backend", default=None)
    parser.addini("ddp_device", "default --ddp-device", default=None)
    parser.addini("ddp_timeout", "default --ddp-timeout", default=None)
    parser.addini("ddp_rank_threads", "default --ddp-rank-threads", default=None)
    parser.addini("ddp_start_timeout", "default --ddp-start-timeout", default=None)


def _flag(name: str) -> str:
    return "--ddp-trainer" if name == "ddp_trainers" else "--" + name.replace("_", "-")


def _raw(config: pytest.Config, name: str) -> tuple[str | None, str]:
    """The option's raw value and where it came from, for error messages."""
    value = config.getoption(name)
    if value is not None:
        return str(value), _flag(name)
    value = config.getini(name)
    if value not in (None, "", []):
        return str(value), f"ini option {name}"
    return None, ""


def _int(config: pytest.Config, name: str, minimum: int, default: int | None) -> int | None:
    raw, where = _raw(config, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise pytest.UsageError(f"{where}: expected an integer >= {minimum}, got {value}")
    return value


def _seconds(config: pytest.Config, name: str, default: float) -> float:
    raw, where = _raw(config, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected a number of seconds > 0, got {raw!r}") from None
    if not value > 0:
        raise pytest.UsageError(f"{where}: expected a number of seconds > 0, got {raw!r}")
    return value


def read_settings(config: pytest.Config) -> Settings:
    """Validate the options once, at configure time, so bad input stops the session in one line."""
    world_size = _int(config, "ddp_world_size", 1, DEFAULT_WORLD_SIZE)
    raw, where = _raw(config, "ddp_backend")
    backend = (raw or "auto").strip().lower()
    if backend not in BACKENDS:
        raise pytest.UsageError(f"{where}: expected one of {', '.join(BACKENDS)}, got {raw!r}")
    device = _device(config, backend)
    timeout = _seconds(config, "ddp_timeout", DEFAULT_TIMEOUT)
    start_timeout = _seconds(config, "ddp_start_timeout", max(timeout, 60.0))
    threads = _int(config, "ddp_rank_threads", 1, None)
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        threads = 1
    assert world_size is not None
    typed = config.getoption("ddp_trainers")
    trainers = tuple(typed or config.getini("ddp_trainers") or ("torch", "lightning"))
    # a file SPEC typed on the command line is relative to where it was typed, like any path typed
    # there (--ddp-config and --ddp-report are used as typed, relative to the working directory); one
    # from an ini file is relative to the rootdir. Never the rootdir for a typed one: pytest picks the
    # rootdir before it knows plugin options, so `--ddp-report ../logs/r.json` moves it up once that
    # file exists
    spec_base = config.invocation_params.dir if typed else config.rootpath
    return Settings(world_size=world_size, backend=backend, timeout=timeout, start_timeout=start_timeout,
                    rank_threads=threads, device=device, trainers=trainers, config_path=_path(config, "ddp_config"),
                    report_path=_path(config, "ddp_report"), checks=_checks(config),
                    advise=bool(config.getoption("ddp_advise") or config.getini("ddp_advise")),
                    max_steps=_int(config, "ddp_max_steps", 1, None),
                    spec_base=str(spec_base))


def _checks(config: pytest.Config) -> tuple[str, ...]:
    raw, where = _raw(config, "ddp_checks")
    if raw is None:
        return DEFAULT_CHECKS
    try:
        return parse_checks(raw)
    except ValueError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None


def _device(config: pytest.Config, backend: str) -> str:
    raw, where = _raw(config, "ddp_device")
    device = (raw or "auto").strip().lower()
    if device not in DEVICES:
        raise pytest.UsageError(f"{where}: expected one of {', '.join(DEVICES)}, got {raw!r}")
    if device == "cpu" and backend == "nccl":
        raise pytest.UsageError(f"{where}: cpu cannot run with --ddp-backend nccl, which runs on GPUs only; "
                                "expected cuda or auto, or --ddp-backend gloo")
    return device


def _path(config: pytest.Config, name: str) -> str | None:
    """A path option as typed (relative to the working directory), or its ini mirror relative to
    the rootdir, as pytest's own ini paths are."""
    path, _ = _raw(config, name)
    if path is not None and not os.path.isabs(path) and config.getoption(name) is None:
        path = os.path.join(str(config.rootpath), path)
    return path


def where_given(config: pytest.Config, name: str) -> str:
    """How the user gave option `name`, the prefix of every usage line about it: `--ddp-config`
    on the command line, `ini option ddp_config` in an ini file."""
    return _raw(config, name)[1] or _flag(name)


def validate_report_path(config: pytest.Config, settings: Settings) -> None:
    """A report that cannot be written is one usage line before any test runs, not a traceback after
    all of them."""
    if settings.report_path is None:
        return
    reason = unwritable_reason(Path(settings.report_path))
    if reason is not None:
        raise pytest.UsageError(f"{where_given(config, 'ddp_report')}: {settings.report_path}: {reason}; "
                                "expected a file path in a directory this user can write")


def unwritable_reason(path: Path) -> str | None:
    """Why no file can be written at `path`, None if one can; found by trying, without leaving
    anything behind (os.access says yes to root even where the filesystem refuses, as /proc does)."""
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:
            with open(path, "a", encoding="utf-8"):  # appends nothing: the file stays as it is
                pass
        except OSError as exc:
            return f"cannot write it ({exc.strerror or exc})"
        return None
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # the directories it will make
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"cannot create a file in {folder} ({exc.strerror or exc})"
    return None


def suite_preload(config: pytest.Config) -> tuple[str, ...] | None:
    """What the conformance suite's ranks will import, when this session runs the suite here (its
    arguments name `ddp_conformance.suite`, and this is no xdist controller, whose workers run the
    tests); else None. Known before any SPEC is resolved, so that the ranks' start overlaps it."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return None
    named = [arg.split("::")[0].removesuffix(".py").replace(os.sep, ".") for arg in config.args]
    if not any("ddp_conformance.suite" in arg for arg in named):
        return None
    # deferred: the SPEC module's imports (unittest.mock brings asyncio) would slow every pytest start
    from .trainers.spec import SpecError

    try:
        specs = session_trainers(config)
    except SpecError:  # the validation says why, in one line
        return None
    return tuple(dict.fromkeys((*WARMUP, *(name for spec in specs for name in spec.frameworks))))


def validate_trainers_and_config(config: pytest.Config, settings: Settings,
                                 elsewhere: Callable[[str, str], str | None] | None = None) -> None:
    """Read the config and parse every SPEC once in pytest, and resolve the SPECs, so a bad one is one usage
    line before any rank starts (and before pytest's session header). Only when asked for: the defaults
    need no import (built-ins resolve lazily).

    `elsewhere` (the controller's `call_where_ranks_start`) resolves the SPECs that import code where the
    ranks' imports are made already: in pytest's process a `lightning:` SPEC imports Lightning (~4 s of CPU)
    while the fork servers import it for the ranks, on their way to the first test on a 2-core machine.
    Where it answers None (no such place), they are resolved here."""
    # deferred: the SPEC module's imports (unittest.mock brings asyncio) would slow every pytest start
    from .trainers.spec import SpecError, problem_of

    try:
        specs = session_trainers(config)
    except SpecError as exc:
        raise _spec_usage_error(config, settings, str(exc)) from None
    importing = [spec for spec in specs if spec.imports_code] if elsewhere is not None else []
    problem = problem_of(spec for spec in specs if spec not in importing)
    if not problem and importing:
        assert elsewhere is not None
        problem = elsewhere("ddp_conformance.trainers.spec:first_problem",
                            json.dumps([[spec.text, spec.base] for spec in importing]))
        if problem is None:
            problem = problem_of(importing)
    if problem:
        raise _spec_usage_error(config, settings, problem)
    if settings.config_path is not None:
        try:
            run_config(config)
        except ConfigError as exc:
            raise pytest.UsageError(f"{where_given(config, 'ddp_config')}: {exc}") from None


def _spec_usage_error(config: pytest.Config, settings: Settings, message: str) -> pytest.UsageError:
    """A SpecError's line as the usage line naming where the SPEC was given (every SpecError message
    starts with its SPEC's prefix)."""
    # deferred: the SPEC module's imports (unittest.mock brings asyncio) would slow every pytest start
    from .trainers.spec import message_prefix

    text = next(t for t in settings.trainers if message.startswith(message_prefix(t.strip())))
    reason = message.removeprefix(message_prefix(text.strip()))
    return pytest.UsageError(f"{where_given(config, 'ddp_trainers')}: {text!r}: {reason}")


PATH_OPTIONS = ("--ddp-report", "--ddp-config")
INI_FILES = (("pytest.ini", ""), (".pytest.ini", ""), ("pyproject.toml", "[tool.pytest"), ("tox.ini", "[pytest]"),
             ("setup.cfg", "[tool:pytest]"))


def refuse_path_taken_for_a_test_path(config: pytest.Config) -> None:
    """pytest picks its rootdir and ini file before plugins add their options, so the value of
    `--ddp-report PATH` (separate word) counts there as a test path: once PATH exists outside the
    repo, the rootdir moves up and the repo's ini file (with its `ddp_trainers` line) is silently
    ignored. That is one usage line here, with the spelling that avoids it, never a quiet other run."""
    args = [str(arg) for arg in config.invocation_params.args]
    for option, value in itertools.pairwise(args):
        if option not in PATH_OPTIONS or not os.path.exists(value):
            continue
        expected = _ini_file_above(config.invocation_params.dir)
        if expected is not None and expected != config.inipath:
            raise pytest.UsageError(
                f"{option}: {value}: pytest took this existing path for a test path when it chose its rootdir "
                f"(it does so before plugin options are known), so it ignored {expected}; write {option}={value}")


def _ini_file_above(directory: Path) -> Path | None:
    """The ini file pytest finds from `directory` upwards when given no test path (its documented search)."""
    for folder in (directory, *directory.parents):
        for name, section in INI_FILES:
            candidate = folder / name
            if candidate.is_file() and (not section or section in candidate.read_text(errors="replace")):
                return candidate
    return None
