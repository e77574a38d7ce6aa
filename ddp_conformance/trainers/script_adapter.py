"""Both processes: a training script checked by its command line: `script:` SPECs, no adapter code.

    script:train.py --steps {steps} --ckpt-dir {checkpoint_dir} --ckpt-every {checkpoint_at} \
        | train.py --steps {steps} --resume {checkpoint}          (one line)

Left of `|` (a `|` outside quotes, spaces around it or not): the command line that trains from
scratch; right of it (optional): the one that resumes. Placeholders:

    {steps}            both lines  optimizer steps to train to (the resume line: in all, counting the
                                   checkpoint's)
    {epochs}           both lines  for a script that takes epochs, not steps: see below
    {checkpoint_dir}   fit line    a directory of this fit's own, always given (empty)
                       resume line the directory holding the checkpoint to resume (a fresh copy of it):
                                   for a script that resumes from its output directory (nanoGPT's
                                   `--out_dir`, which loads out_dir/ckpt.pt)
    {checkpoint_at}    fit line    the step to checkpoint at, 0 when the fit writes no checkpoint;
    {checkpoint_at:-N}             the same, but N when it writes none (`--eval_interval
                                   {checkpoint_at:-100000}`: an interval flag that must not be 0)
    {checkpoint}       resume line the checkpoint file to resume from (in that fresh copy)
    {checkpoint_at}    resume line the step the checkpoint was written at: `{checkpoint_dir}/checkpoint-{checkpoint_at}`
                                   (transformers Trainer), `{checkpoint_dir}/step_{checkpoint_at}` (accelerate)
    {checkpoint_latest} resume line the latest checkpoint directly under that copy (highest number in its name,
                                   else newest), as the fit's directory stood at the checkpoint step
    {accumulate_grad_batches}  both lines  the run config's accumulate_grad_batches: for a script that
                                   takes its accumulation as a flag; accumulation_equivalence then runs
                                   it at 1 for its reference (without it the config is a claim)

`{{` and `}}` are literal braces; anything else in braces is a SPEC error naming the argument. Paths
are relative to the SPEC's base (where it was typed; the rootdir for an ini line).

Every fit runs in a fresh working directory of its own, which is its `{checkpoint_dir}`, and every
resume in the fresh copy of the checkpoint's directory: a script that snapshots to `snapshot.pt` in its
working directory and resumes from it whenever it exists (the PyTorch DDP tutorial's
multigpu_torchrun.py) has its checkpoint found by the resume and by no other fit or session. So that
the script's relative inputs (`data/`, `config/...`) still resolve, that directory holds a symbolic
link to each entry of the SPEC's base while the script runs (removed after it), except checkpoint-like
files (`*.pt`, `*.pth`, `*.ckpt`, `*.safetensors`) an earlier run there left, which are named. Files
the script writes in the base itself (through one of those links, or by an absolute path) are named
in the check's notes; the base is not listed when it holds more than 20000 files.

Steps are counted, not trusted: the harness sees every optimizer step, and ends a script when it
begins a step past the steps asked, so every fit the checks judge took the steps they asked for. A
script ended so is noted, naming the argument that carried `{steps}` (nanoGPT's `--max_iters` counts
from 0 inclusive, and saves at the top of the iteration after the step it checkpoints). A fit that
took fewer steps, or a line where no argument carries `{steps}` or `{epochs}` (steps hard-coded in the
SPEC), stops the trainer's checks with one line naming the SPEC and that argument. A line with
`{epochs}` is given that many epochs as steps were asked (every epoch has at least one step) and the
harness ends the script right after its asked-for optimizer steps; a fit that checkpoints ends at
the next optimizer step instead, after the epoch-end save (such a SPEC tells resume_fidelity that it
checkpoints at epoch ends). A resume counts from the step its checkpoint was written at.

In every rank the script runs as torchrun would run it: `sys.argv`, RANK / LOCAL_RANK / WORLD_SIZE /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, `__name__ == "__main__"`, its own folder first on
`sys.path`. Its `init_process_group` joins the harness's group (the call is answered by the group
that already exists) and its `destroy_process_group` leaves it standing for the next check;
`sys.exit(0)` ends a fit, any other exit code fails it. A line may begin with `accelerate launch [its flags]`: the
script then also gets the ACCELERATE_* variables the launcher would set (`accelerate_launch.py`).

A resume line that names its checkpoint by `{checkpoint_at}` or `{checkpoint_latest}` says a later save goes
elsewhere (`checkpoints_once`): resume_fidelity's fit to n writes the checkpoint on its way, so a schedule set by
the total steps is the user's. Each resume's copy holds rank 0's directory as it was at step k with every other
rank's own files merged in (per-rank RNG states: `script_checkpoints.py`). What the script did is observed through the
harness's hooks (`checks/support/observe.py`), so every check judges the real run: data_consistency the
dataset its training loader iterated, gradient_equivalence its first step against the same script
rerun in a world of one (`checks/gradient_equivalence/script_step.py`), bucket_view_memory its own DDP and its gradients
at the optimizer step; what a script lacks for one of them is a skip naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from ..adapter import NotProvided, TrainerAdapter, TrainerBuildError
from ..runner.rank.seeds import fresh_seeds
from .accelerate_launch import LaunchError, is_launcher
from .accelerate_launch import environment as launcher_environment
from .accelerate_launch import split as split_launcher
from .accelerate_state import reset as reset_accelerate_state
from .script_checkpoints import EntryWatch, FitCheckpoint, copy_for_resume, fit_of, remember
from .script_checkpoints import latest as latest_checkpoint
from .script_links import LinkedInputs

SCRIPT_PREFIX = "script:"
FIT_FIELDS = ("steps", "epochs", "checkpoint_dir", "checkpoint_at", "accumulate_grad_batches")
RESUME_FIELDS = ("steps", "epochs", "checkpoint_dir", "checkpoint", "checkpoint_at", "checkpoint_latest",
                 "accumulate_grad_batches")
# a resume line that names its checkpoint by these finds the one at k whatever the fit saved after it
STEP_NAMED = ("checkpoint_at", "checkpoint_latest")
DEFAULTED = "checkpoint_at"  # the one placeholder that can be absent, so the one with a `:-N` form
_BRACES = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_FIELD = re.compile(r"(?P<name>[a-z_]+)(?::-(?P<default>[^{}]*))?")


class ScriptSpecError(ValueError):
    """A `script:` SPEC that cannot run: missing script, unknown placeholder."""


class _Enough(BaseException):
    """Ends a script at the step the harness asked for (a BaseException: a script's `except
    Exception` must not swallow it)."""


@dataclass(frozen=True)
class Command:
    """One command line of a `script:` SPEC: the script's absolute path, then its argument templates."""

    line: str  # "fit" or "resume"
    script: str
    args: tuple[str, ...]
    launcher: tuple[str, ...] | None = None  # `accelerate launch`'s own arguments, where it launches the script

    def carrier(self, name: str) -> str | None:
        """The first argument that carries the placeholder `name`, with the flag before it when it is
        the flag's value (`--max_iters {steps}`)."""
        for at, arg in enumerate(self.args):
            if any(f == name for f, _ in _fields(arg)):
                flag = self.args[at - 1] if at and self.args[at - 1].startswith("-") and arg.startswith("{") else ""
                return f"{flag} {arg}" if flag else arg
        return None

    def argv(self, values: dict[str, str | None]) -> list[str]:
        return [self.script, *(_render(arg, values) for arg in self.args)]


def parse_script_spec(spec: str, base: Path) -> tuple[Command, Command | None]:
    """The fit and resume command lines of a `script:` SPEC; one-line ScriptSpecError if it cannot run."""
    body = spec[len(SCRIPT_PREFIX):].strip()
    parts = _split_lines(body)
    if len(parts) > 2:
        raise ScriptSpecError("more than one '|' outside quotes: expected script:train.py ARGS [| train.py ARGS]")
    try:
        lines = [shlex.split(part) for part in parts]
    except ValueError as exc:
        raise ScriptSpecError(f"cannot split it into arguments: {exc}") from None
    fit = _command("fit", lines[0], base, FIT_FIELDS)
    resume = _command("resume", lines[1], base, RESUME_FIELDS) if len(lines) > 1 else None
    return fit, resume


def _split_lines(body: str) -> list[str]:
    """`body` cut at each `|` outside quotes, spaces around it or not (`a|b` is two lines); a quoted
    or escaped `|` stays an argument's."""
    parts, start, quote, escaped = [], 0, "", False
    for at, char in enumerate(body):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "|":
            parts.append(body[start:at])
            start = at + 1
    return [*parts, body[start:]]


def _command(line: str, argv: list[str], base: Path, known: tuple[str, ...]) -> Command:
    launcher = None
    if is_launcher(argv):
        try:
            launcher, argv = split_launcher(argv)
        except LaunchError as exc:
            raise ScriptSpecError(f"the {line} line: {exc}") from None
    if not argv:
        raise ScriptSpecError(f"the {line} line names no script: expected script:path/to/train.py ARGS "
                              "[| path/to/train.py ARGS]")
    script = Path(argv[0]) if Path(argv[0]).is_absolute() else base / argv[0]
    if not script.is_file():
        raise ScriptSpecError(f"no such script: {script}")
    for arg in argv[1:]:
        for name, default in _fields(arg):
            if name in known and default is not None and name != DEFAULTED:
                raise ScriptSpecError(f"argument {arg!r}: only {{{DEFAULTED}}} takes a ':-N' default, "
                                      f"{{{name}}} is always given")
            if name not in known or (default is not None and name != DEFAULTED):
                shown = "{" + name + (f":-{default}" if default is not None else "") + "}"
                raise ScriptSpecError(f"argument {arg!r}: {shown} is not a placeholder of the {line} line "
                                      f"({_known(line, known)})")
    return Command(line, str(script), tuple(argv[1:]), launcher)


def _known(line: str, known: tuple[str, ...]) -> str:
    names = ", ".join("{" + name + "}" for name in known)
    extra = f", {{{DEFAULTED}:-N}}" if DEFAULTED in known else ""
    return f"known there: {names}{extra}; {{{{ and }}}} for literal braces"


def _fields(arg: str) -> list[tuple[str, str | None]]:
    """(name, default or None) of each placeholder in `arg`; ScriptSpecError for anything in braces
    that is not one (`{checkpoint.parent}`, a lone brace)."""
    found = []
    for match in _BRACES.finditer(arg):
        text = match.group(0)
        if text in ("{{", "}}"):
            continue
        if text in ("{", "}"):
            raise ScriptSpecError(f"argument {arg!r}: a lone {text!r} (write {text * 2!r} for a literal brace)")
        field = _FIELD.fullmatch(match.group(1))
        if field is None:
            hint = ("; the directory holding the checkpoint is {checkpoint_dir}"
                    if match.group(1).startswith("checkpoint") else "")
            raise ScriptSpecError(f"argument {arg!r}: {text} is not a placeholder (expected {{name}} or "
                                  f"{{{DEFAULTED}:-N}}{hint})")
        found.append((field["name"], field["default"]))
    return found


def _render(arg: str, values: dict[str, str | None]) -> str:
    def value(match: re.Match[str]) -> str:
        text = match.group(0)
        if text in ("{{", "}}"):
            return text[0]
        field = _FIELD.fullmatch(match.group(1))
        assert field is not None  # parse_script_spec checked every argument
        given = values.get(field["name"])
        if given is None:
            return field["default"] if field["default"] is not None else "0"
        return given

    return _BRACES.sub(value, arg)


class ScriptAdapter(TrainerAdapter):
    """Runs the SPEC's command lines as the trainer's fit and resume."""

    takes_config = False  # the script reads its command line; the run config's devices etc. do not reach it

    def __init__(self, spec: str, base: Path) -> None:
        self.spec = spec
        self.fit_command, self.resume_command = parse_script_spec(spec, base)
        self.base = Path(base)
        self.name = Path(self.fit_command.script).stem
        self.conformance_notes: list[str] = []  # the checks add them to their figures (CheckContext.finish)
        if self.fit_command.carrier("epochs"):
            self.checkpoint_every = "epoch"
        # a resume line that names the checkpoint by its step ({checkpoint_at}) or as the latest at k finds the
        # one written at k whatever the fit saves after it: the fit to n, as the user runs it, writes it on the
        # way (a schedule set by the total steps is then the user's)
        self._watch: EntryWatch | None = None
        self.checkpoints_once = self.resume_command is not None and any(
            self.resume_command.carrier(name) for name in STEP_NAMED)

    def fit(self, steps: int, *, checkpoint_dir: Path | None = None, checkpoint_at: int | None = None,
            observer: Any = None) -> None:
        if checkpoint_at and self.resume_command is None:  # a checkpoint no command line could resume from
            raise self._no_resume()
        directory = Path(checkpoint_dir) if checkpoint_dir else self._own_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # a fit from scratch is a fresh torchrun process: its own seeds on every rank, not what an earlier
        # fit in this rank left (a script that seeds after an unseeded random_split would otherwise hand
        # its seed to the next fit's split, and every rank would draw the same one). A resume keeps the RNG
        # as the check sets it: resume_fidelity resumes with the checkpoint's RNG to tell what is lost.
        fresh_seeds()
        values = {"steps": str(steps), "epochs": str(steps), "checkpoint_dir": str(directory),
                  "checkpoint_at": str(checkpoint_at) if checkpoint_at else None, **self._accumulation()}
        self._watch = EntryWatch(directory, checkpoint_at) if checkpoint_at else None
        taken, overran = self._run(self.fit_command, directory, values, steps, past_save=bool(checkpoint_at))
        self._check_steps(self.fit_command, f"fit({steps})", steps, taken, overran)
        if checkpoint_at and self._watch is not None:
            self._remember(directory, checkpoint_at, self._watch, steps)

    @property
    def carries_accumulation(self) -> bool:
        """Whether the fit line passes `{accumulate_grad_batches}`: the config's k reaches the script, and a
        check can run it at k = 1 (accumulation_equivalence's reference)."""
        return self.fit_command.carrier("accumulate_grad_batches") is not None

    def _accumulation(self) -> dict[str, str]:
        return {"accumulate_grad_batches": str(self.config.trainer.accumulate_grad_batches)}

    def make_dataset(self, size: int | None = None) -> Any:
        raise NotProvided(self, "make_dataset", "a script: SPEC runs the whole script; its dataset cannot be built "
                                                "on its own (write a small adapter for the checks that need one)")

    def make_model(self) -> Any:
        raise NotProvided(self, "make_model", "a script: SPEC runs the whole script; its model cannot be built on "
                                              "its own (write a small adapter for the checks that need one)")

    def resume(self, checkpoint: Path, steps: int, *, observer: Any = None) -> None:
        """Resume a fresh copy of the checkpoint's directory: a script that resumes from its
        --checkpoint_path also saves there, and the check resumes the same checkpoint more than once."""
        if self.resume_command is None:
            raise self._no_resume()
        checkpoint = Path(checkpoint)
        copy = self._own_dir()
        written = fit_of(checkpoint)
        if written is None:  # a checkpoint no fit of this adapter recorded: its directory, as it is
            shutil.copytree(checkpoint.parent, copy, dirs_exist_ok=True)
            inside = Path(checkpoint.name)
        else:  # rank 0's directory as it was at k, with every other rank's own files (their RNG states)
            copy_for_resume(written, copy)
            inside = checkpoint.relative_to(written.directory) if checkpoint.is_relative_to(written.directory) \
                else Path(checkpoint.name)
        start = written.step if written is not None else None
        latest = latest_checkpoint(copy)
        values = {"steps": str(steps), "epochs": str(steps), "checkpoint_dir": str(copy),
                  "checkpoint": str(copy / inside), "checkpoint_at": str(start) if start is not None else None,
                  "checkpoint_latest": str(latest) if latest is not None else str(copy), **self._accumulation()}
        left = steps - start if start is not None else None
        taken, overran = self._run(self.resume_command, copy, values, left, past_save=False)
        if left is not None:
            self._check_steps(self.resume_command, f"resume(step {start} -> {steps})", left, taken, overran)

    def _run(self, command: Command, cwd: Path, values: dict[str, str | None], limit: int | None,
             past_save: bool) -> tuple[int, bool]:
        """Run `command` in `cwd` (its checkpoint directory, fresh), counting its optimizer steps:
        (steps taken, whether it tried to take more than `limit`)."""
        before = _listing(self.base)
        epochs = command.carrier("epochs") is not None
        counter = _StepCounter(limit, stop_at_limit=epochs and not past_save)
        counter.watch = self._watch if command is self.fit_command else None
        env = launcher_environment(command.launcher) if command.launcher is not None else None
        with self._linked_inputs(cwd), counter:
            run_script(command.argv(values), cwd, env)
        self._name_writes(before, command)
        return counter.taken, counter.overran and not (epochs and past_save)

    @contextlib.contextmanager
    def _linked_inputs(self, cwd: Path) -> Iterator[None]:
        """The base's entries linked into `cwd` while the script runs (`script_links`), and what became of them
        in the fit's notes."""
        inputs = LinkedInputs(self.base, cwd)
        try:
            with inputs.standing():
                yield
        finally:
            if inputs.hidden:
                self._note(f"not shown to the script: {', '.join(inputs.hidden[:3])} in {self.base} (a checkpoint "
                           "left by an earlier run there; every fit starts in a fresh working directory)")
            if inputs.diverted:
                self._note(f"the script wrote {', '.join(inputs.diverted[:3])} into {{checkpoint_dir}}, where the "
                           f"harness linked the file of that name in {self.base} for it to read: it wrote a file of "
                           f"its own there, and {self.base}'s is unchanged")

    def _name_writes(self, before: dict[str, tuple[int, int]] | None, command: Command) -> None:
        """Name the files the script wrote into the SPEC's folder, outside {checkpoint_dir}."""
        after = _listing(self.base)
        if before is None or after is None:
            return
        written = sorted(path for path, stamp in after.items() if before.get(path) != stamp)
        if written:
            more = f" and {len(written) - 3} more" if len(written) > 3 else ""
            self._note(f"{Path(command.script).name} ({command.line} line) wrote {', '.join(written[:3])}{more} "
                       f"in {self.base}, outside {{checkpoint_dir}}: files a later fit or session may read")

    def _note(self, text: str) -> None:
        if text not in self.conformance_notes:
            self.conformance_notes.append(text)

    def _check_steps(self, command: Command, call: str, asked: int, taken: int, overran: bool) -> None:
        """Stop the trainer's checks, naming the SPEC, when the script took fewer steps than asked or
        no argument gives it its steps; note it when it began more (it was ended at the steps asked,
        so what the checks judged is the run they asked for)."""
        carrier = command.carrier("steps") or command.carrier("epochs")
        if carrier is not None and overran:
            self._note(f"{call}: the script began optimizer step {asked + 1} and was ended after step {asked}: "
                       f"does the argument {carrier!r} count from 0, or count something else than optimizer steps?")
            return
        if taken == asked and not overran:
            return
        if carrier is None:
            why = (f"no argument of its {command.line} line carries {{steps}} or {{epochs}} (steps fixed in the "
                   "SPEC or the script?)")
        elif command.carrier("steps") is None:
            why = (f"the argument {carrier!r} gave it {asked} epochs (each at least one optimizer step), so the "
                   "script does not train for that argument's epochs")
        else:
            why = (f"the argument {carrier!r} does not give the script its optimizer steps (does that flag count "
                   "micro-batches, or epochs?)")
        shown = f"more than {asked}" if overran else str(taken)
        raise TrainerBuildError(f"trainer SPEC {self.spec!r}: {call} took {shown} optimizer steps, not {asked}: {why}")

    def _remember(self, directory: Path, step: int, watch: EntryWatch, steps: int) -> None:
        """Record where this rank's fit checkpointed at `step` (a resume is handed rank 0's checkpoint and
        must know where it starts, and find every rank's files); a fit that went on and rewrote what it had
        written by step k (one name saved at every interval) left no checkpoint at k to resume."""
        entries = watch.finish()
        rewritten = watch.rewritten() if steps > step else []
        remember(FitCheckpoint(directory, step, self.ctx.rank, entries))
        if rewritten:
            raise NotProvided(self, f"a checkpoint at step {step} in a fit to {steps}", (
                f"the script rewrote {', '.join(rewritten[:3])} after step {step}, so the checkpoint at {step} is gone "
                "by the end of the fit (its resume line names the checkpoint by {checkpoint_at} or "
                "{checkpoint_latest}, which says a later save goes elsewhere)"))

    def _no_resume(self) -> NotProvided:
        return NotProvided(self, "resume", "its script: SPEC has no resume command line (add ' | train.py ...')")

    def _own_dir(self) -> Path:
        """A directory no other fit has used: every check builds fresh adapters, and a script that
        resumes from whatever checkpoint it finds at its path (torchrun's restart pattern) must never
        find another fit's."""
        parent = self.ctx.workdir / "script-fits"
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"rank{self.ctx.rank}-", dir=parent))


def _listing(folder: Path, limit: int = 20000) -> dict[str, tuple[int, int]] | None:
    """(mtime, size) of every file under `folder` by relative path, not following links; None for a
    folder too large to list before and after every fit."""
    found: dict[str, tuple[int, int]] = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in (".git", "__pycache__")]
        for name in names:
            path = Path(root, name)
            try:
                stat = path.lstat()
            except OSError:
                continue
            found[str(path.relative_to(folder))] = (stat.st_mtime_ns, stat.st_size)
            if len(found) > limit:
                return None
    return found


class _StepCounter:
    """Counts the optimizer steps of the first optimizer that steps (a script's main one), as the script
    counts them: a step its GradScaler skips (`scaler.step` on gradients that hold inf or NaN, which never
    calls `optimizer.step`) counts too, as it does in the script's loop and in the recorder. Ends the script
    (`_Enough`) when it begins a step past `limit`, or, with `stop_at_limit`, right after step `limit`."""

    def __init__(self, limit: int | None, stop_at_limit: bool) -> None:
        self.limit, self.stop_at_limit = limit, stop_at_limit
        self.taken, self.overran = 0, False
        self._main: Any = None
        self.watch: EntryWatch | None = None  # lists the fit's directory as step k + 1 begins
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _StepCounter:
        # deferred: torch is heavy to import
        from torch.amp import GradScaler
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._stack.callback(register_optimizer_step_pre_hook(self._on_optimizer_pre_step).remove)
        self._stack.callback(register_optimizer_step_post_hook(self._after).remove)
        scaler_step = GradScaler.step  # the recorder's wrapper, where a fit is recorded: put back on exit
        GradScaler.step = self._scaler_step(scaler_step)  # type: ignore[method-assign]
        self._stack.callback(setattr, GradScaler, "step", scaler_step)
        return self

    def __exit__(self, kind: Any, exc: Any, _tb: Any) -> bool:
        self._stack.close()
        return kind is _Enough

    def _on_optimizer_pre_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._main is None:
            self._main = optimizer
        if optimizer is self._main and self.watch is not None:
            self.watch.at_step(self.taken)
        if optimizer is self._main and self.limit is not None and self.taken >= self.limit:
            self.overran = True
            raise _Enough

    def _after(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if optimizer is not self._main:
            return
        self.taken += 1
        if self.stop_at_limit and self.taken == self.limit:
            raise _Enough

    def _scaler_step(self, original: Any) -> Any:
        counter = self

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = counter.taken
            if counter._main is None or optimizer is counter._main:
                # a skipped step begins too: past `limit`, it ends there
                counter._on_optimizer_pre_step(optimizer, args, kwargs)
            result = original(scaler, optimizer, *args, **kwargs)
            if optimizer is counter._main and counter.taken == before:  # skipped: no optimizer.step ran
                counter._after(optimizer, args, kwargs)
            return result

        return step


def run_script(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run the script once, in this process, as torchrun (or, with `env`, `accelerate launch`) started in
    `cwd` would start it: a fresh process holds no accelerate state, so none is kept from an earlier run."""
    script, args = argv[0], argv[1:]
    reset_accelerate_state()
    with _as_torchrun(script, args, cwd, env or {}):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise RuntimeError(f"{Path(script).name} exited with code {exc.code!r}") from None
        finally:
            reset_accelerate_state()


@contextlib.contextmanager
def _as_torchrun(script: str, args: list[str], cwd: Path, launched: dict[str, str]) -> Iterator[None]:
    import torch.distributed as dist  # deferred: torch is heavy to import

    directory = str(Path(script).parent)  # sys.path[0], as `python script.py` has it
    env = {"LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")),
           "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
           "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"), **launched}
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
    import torch.distributed as dist  # deferred: torch is heavy to import

    if not dist.is_initialized():
        raise RuntimeError("the harness's process group is gone; the script cannot join it")
