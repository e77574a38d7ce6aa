"""A training script checked by its command line: `script:` SPECs, no adapter code.

    script:train.py --steps {steps} --ckpt-dir {checkpoint_dir} --ckpt-at {checkpoint_at} \
        | train.py --steps {steps} --resume {checkpoint}          (one line)

Left of ` | `: the command line that trains from scratch; right of it (optional): the one that
resumes. Placeholders: `{steps}` (optimizer steps to train to), `{checkpoint_dir}` (a directory of
this fit's own, always given), `{checkpoint_at}` (the step to checkpoint at, 0 for none) and, in the
resume line, `{checkpoint}` (the file to resume from). Paths are relative to where the SPEC was
typed (the rootdir for an ini line).

In every rank the script runs as torchrun would run it: `sys.argv`, the working directory, RANK /
LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, `__name__ == "__main__"`.
Its `init_process_group` joins the harness's group (the call is answered by the group that already
exists) and its `destroy_process_group` leaves it standing for the next check; `sys.exit(0)` ends a
fit, any other exit code fails it. What the script did is observed through the harness's hooks
(`checks/observe.py`), so rank_participation, sampler_disjointness and resume_fidelity judge the
real run; checks that need a piece in isolation (a dataset, a model, a loss) skip with the reason.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from ..adapter import NotProvided, TrainerAdapter

SCRIPT_PREFIX = "script:"
FIT_FIELDS = {"steps", "checkpoint_dir", "checkpoint_at"}
RESUME_FIELDS = {"steps", "checkpoint"}


class ScriptSpecError(ValueError):
    """A `script:` SPEC that cannot run: missing script, unknown placeholder."""


def parse_script_spec(spec: str, base: Path) -> tuple[list[str], list[str] | None]:
    """The fit and resume command lines of a `script:` SPEC, script paths made absolute."""
    body = spec[len(SCRIPT_PREFIX):].strip()
    fit_text, _, resume_text = body.partition(" | ")
    lines = [_command(fit_text, base, FIT_FIELDS)]
    if resume_text.strip():
        lines.append(_command(resume_text, base, RESUME_FIELDS))
    return lines[0], lines[1] if len(lines) > 1 else None


def _command(text: str, base: Path, fields: set[str]) -> list[str]:
    argv = shlex.split(text)
    if not argv:
        raise ScriptSpecError("no script named: expected script:path/to/train.py ARGS [| path/to/train.py ARGS]")
    script = Path(argv[0]) if Path(argv[0]).is_absolute() else base / argv[0]
    if not script.is_file():
        raise ScriptSpecError(f"no such script: {script}")
    for arg in argv[1:]:
        try:
            arg.format(**dict.fromkeys(fields, ""))
        except (KeyError, IndexError, ValueError) as exc:
            raise ScriptSpecError(f"argument {arg!r}: unknown placeholder {exc} (known: "
                                  f"{', '.join('{' + f + '}' for f in sorted(fields))})") from None
    return [str(script), *argv[1:]]


class ScriptAdapter(TrainerAdapter):
    """Runs the SPEC's command lines as the trainer's fit and resume."""

    def __init__(self, spec: str, base: Path) -> None:
        self.fit_argv, self.resume_argv = parse_script_spec(spec, base)
        self.base = base
        self.name = Path(self.fit_argv[0]).stem

    def fit(self, steps: int, *, checkpoint_dir: Path | None = None, checkpoint_at: int | None = None,
            observer: Any = None) -> None:
        if checkpoint_at and self.resume_argv is None:  # a checkpoint no command line could resume from
            raise self._no_resume()
        directory = Path(checkpoint_dir) if checkpoint_dir else self._own_dir()
        run_script(self.fit_argv, self.base, steps=steps, checkpoint_dir=directory, checkpoint_at=checkpoint_at or 0)

    def make_dataset(self, size: int | None = None) -> Any:
        raise NotProvided(self, "make_dataset", "a script: SPEC runs the whole script; its dataset cannot be built "
                                                "on its own (write a small adapter for the checks that need one)")

    def make_model(self) -> Any:
        raise NotProvided(self, "make_model", "a script: SPEC runs the whole script; its model cannot be built on "
                                              "its own (write a small adapter for the checks that need one)")

    def resume(self, checkpoint: Path, steps: int, *, observer: Any = None) -> None:
        if self.resume_argv is None:
            raise self._no_resume()
        run_script(self.resume_argv, self.base, steps=steps, checkpoint=self._copy_of(Path(checkpoint)))

    def _copy_of(self, checkpoint: Path) -> Path:
        """The checkpoint's directory copied into a fresh one: a script that resumes from its
        --checkpoint_path also saves there, and the check resumes the same checkpoint more than once."""
        directory = self._own_dir()
        shutil.copytree(checkpoint.parent, directory, dirs_exist_ok=True)
        return directory / checkpoint.name

    def _no_resume(self) -> NotProvided:
        return NotProvided(self, "resume", "its script: SPEC has no resume command line (add ' | train.py ...')")

    def _own_dir(self) -> Path:
        """A directory no other fit has used: every check builds fresh adapters, and a script that
        resumes from whatever checkpoint it finds at its path (torchrun's restart pattern) must never
        find another fit's."""
        parent = self.ctx.workdir / "script-fits"
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"rank{self.ctx.rank}-", dir=parent))


def run_script(argv: list[str], cwd: Path, **fields: Any) -> None:
    """Run the script once, in this process, as torchrun started in `cwd` would start it."""
    args = [arg.format(**fields) for arg in argv[1:]]
    script = argv[0]
    with _as_torchrun(script, args, cwd):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise RuntimeError(f"{Path(script).name} exited with code {exc.code!r}") from None


@contextlib.contextmanager
def _as_torchrun(script: str, args: list[str], cwd: Path) -> Iterator[None]:
    import torch.distributed as dist

    directory = str(Path(script).parent)  # sys.path[0], as `python script.py` has it
    env = {"LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")),
           "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
           "MASTER_PORT": os.environ.get("MASTER_PORT", "29500")}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(sys, "argv", [script, *args]))
        stack.enter_context(mock.patch.object(sys, "path", [directory, *sys.path]))
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(dist, "init_process_group", _join_existing_group))
        stack.enter_context(mock.patch.object(dist, "destroy_process_group", lambda *a, **k: None))
        stack.callback(os.chdir, os.getcwd())
        os.chdir(cwd)
        yield


def _join_existing_group(*_args: Any, **_kwargs: Any) -> None:
    """The script's `init_process_group`: the harness's group already exists, and is the script's."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("the harness's process group is gone; the script cannot join it")
