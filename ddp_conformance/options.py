"""Command-line and ini options of the plugin, and their validation.

Every option has an ini mirror so a repo can pin its settings in one line of pytest config; the
command line wins. Bad values become one-line usage errors here, before anything is spawned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT = 120.0


@dataclass(frozen=True)
class Settings:
    """The validated options of one pytest session."""

    world_size: int
    backend: str
    timeout: float
    rank_threads: int | None


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
        "--ddp-timeout", dest="ddp_timeout", default=None, metavar="SECONDS",
        help=f"wall-clock limit of one distributed test (default {DEFAULT_TIMEOUT:g}).",
    )
    group.addoption(
        "--ddp-rank-threads", dest="ddp_rank_threads", default=None, metavar="N",
        help="intra-op threads per rank (default: OMP_NUM_THREADS if set, else 1, as torchrun does).",
    )
    parser.addini("ddp_world_size", "default --ddp-world-size", default=None)
    parser.addini("ddp_backend", "default --ddp-backend", default=None)
    parser.addini("ddp_timeout", "default --ddp-timeout", default=None)
    parser.addini("ddp_rank_threads", "default --ddp-rank-threads", default=None)


def _raw(config: pytest.Config, name: str) -> tuple[str | None, str]:
    """The option's raw value and where it came from, for error messages."""
    value = config.getoption(name)
    if value is not None:
        return str(value), "--" + name.replace("_", "-")
    value = config.getini(name)
    if value not in (None, ""):
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


def read_settings(config: pytest.Config) -> Settings:
    """Validate the options once, at configure time, so bad input stops the session in one line."""
    world_size = _int(config, "ddp_world_size", 1, DEFAULT_WORLD_SIZE)
    raw, where = _raw(config, "ddp_backend")
    backend = (raw or "auto").strip().lower()
    if backend not in BACKENDS:
        raise pytest.UsageError(f"{where}: expected one of {', '.join(BACKENDS)}, got {raw!r}")
    raw, where = _raw(config, "ddp_timeout")
    timeout = DEFAULT_TIMEOUT
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            raise pytest.UsageError(f"{where}: expected a number of seconds > 0, got {raw!r}") from None
        if not timeout > 0:
            raise pytest.UsageError(f"{where}: expected a number of seconds > 0, got {raw!r}")
    threads = _int(config, "ddp_rank_threads", 1, None)
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        threads = 1
    assert world_size is not None
    return Settings(world_size=world_size, backend=backend, timeout=timeout, rank_threads=threads)
