"""Turning every rank's answer into one outcome, and one report a person can act on.

A distributed test passes only if every rank passes. A failure names every failing rank, merges
the ranks' tracebacks when they are the same error ("ranks 1, 3"), and puts the first failing rank's
cause in the first line. "The same error" ignores what legitimately differs between ranks: rank ids,
pids, tensor values, object addresses, temp paths (an adapter's NameError gave one traceback per
rank, identical but for `rank=0` / `rank=1` in one line). A rank's captured output is capped,
head and tail kept: a rank that prints in a loop must not bury the verdict.
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..frames import is_harness, is_users
from ..ranks import ranks_label
from ..wire import FAILED, PASSED, SKIPPED, XFAILED, Outcome, PoolRun, RankEnd, RankReply


@dataclass
class Verdict:
    outcome: Outcome
    headline: str = ""
    body: str = ""
    failing_ranks: list[int] = field(default_factory=list)
    exc_type: tuple[str, str] | None = None  # the first failing rank's exception, for xfail(raises=)
    message: str = ""  # the first failing rank's one-line error, whole (the headline clips it)
    figures: dict[int, dict[str, Any]] = field(default_factory=dict)
    location: str = ""  # "path:line" in the user's code where the first failing rank's error was raised
    died: str = ""  # "rank 1 died (killed by SIGKILL (9))": the ranks whose process ended mid-test, and how

    def render(self) -> str:
        return f"{self.headline}\n{self.body}".rstrip() + "\n"


@dataclass
class CrashLine:
    """`path:line: message`, the one line `--tb=line` prints of a failure (pytest's ReprFileLocation
    has the same face: `message` is what JUnit XML reads); `where: message` without a line."""

    path: str
    lineno: int | None
    message: str

    def __str__(self) -> str:
        where = self.path if self.lineno is None else f"{self.path}:{self.lineno}"
        return f"{where}: {self.message}"


@dataclass
class LineRepr:
    """A failure's report under `--tb=line`: pytest prints `reprcrash` itself, after `toterminal`."""

    reprcrash: CrashLine

    def toterminal(self, out: Any) -> None:
        pass

    def __str__(self) -> str:
        return str(self.reprcrash)


def line_repr(headline: str, location: str, test: str) -> LineRepr:
    """The `--tb=line` report of a distributed test: where the user's code raised (else the test's
    id: a verdict of the harness has no line of the user's), and the verdict's headline."""
    path, _, line = location.rpartition(":")
    if path and line.isdigit():
        return LineRepr(CrashLine(path, int(line), headline))
    return LineRepr(CrashLine(test, None, headline))


def _crash_text(end: RankEnd) -> str:
    return f"{ranks_label([end.rank])} died: {end.detail}"


def _stuck_sections(ends: list[RankEnd], style: str) -> list[str]:
    """Stuck ranks, those whose stacks show the same user frames merged into one section: where they
    wait, then (long style) the user's frames, innermost last as in a traceback."""
    grouped: dict[tuple[str, tuple[tuple[str, int, str], ...]], list[RankEnd]] = {}
    for end in ends:
        frames = _frames(end.stack)
        key = (error_signature(end.detail), tuple(f for f in frames if is_users(f[0])) or tuple(frames))
        grouped.setdefault(key, []).append(end)
    sections = []
    for (_, _), group in grouped.items():
        ranks = [end.rank for end in group]
        frames = _frames(group[0].stack)
        users = [f for f in frames if is_users(f[0])]
        waiting = _waiting_in(frames)
        head = f"{ranks_label(ranks)} {group[0].detail}" + (f", waiting in {waiting}" if waiting else "")
        lines = [f"{'_' * 20} {ranks_label(ranks)} {'_' * 20}", head]
        if style == "line" or style == "no":
            pass
        elif users:
            shown = users if style != "short" else users[:1]
            lines += [f'  File "{path}", line {line} in {func}' for path, line, func in reversed(shown)]
        elif not group[0].stack.strip() or not frames:
            lines.append(group[0].stack.strip() or "(no stack)")
        else:  # stuck outside the user's code: say where, in the libraries' frames only
            lines += [f'  File "{path}", line {line} in {func}'
                      for path, line, func in reversed([f for f in frames if not is_harness(f[0])][:3])]
        sections.append("\n".join(lines))
    return sections


def _waiting_in(frames: list[tuple[str, int, str]]) -> str:
    """The library call a stuck rank waits in (innermost first), named by its function: the
    collective, a sleep, a lock; "" when its innermost frame is the user's own."""
    if not frames or is_users(frames[0][0]):
        return ""
    collective = _collective(frames)
    if collective:
        return collective
    outermost_library = frames[0]
    for frame in frames:
        if is_users(frame[0]) or is_harness(frame[0]):
            break
        outermost_library = frame
    return outermost_library[2]


def judge(run: PoolRun, world_size: int, style: str = "long") -> Verdict:
    replies: dict[int, RankReply] = run.replies
    figures = {rank: reply.figures for rank, reply in replies.items() if reply.figures}
    failed = {rank: reply for rank, reply in replies.items() if reply.outcome == FAILED}
    if failed or run.ends:
        return _failure(run, failed, world_size, figures, style)
    outcomes = {reply.outcome for reply in replies.values()}
    for special in (SKIPPED, XFAILED):
        if special in outcomes:
            reasons = _group(
                {r: rep.message for r, rep in replies.items() if rep.outcome == special}
            )
            text = "; ".join(f"{ranks_label(rs)}: {msg}" if len(reasons) > 1 else msg for msg, rs in reasons)
            return Verdict(special, headline=text, figures=figures)
    assert outcomes <= {PASSED}
    return Verdict(PASSED, figures=figures)


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TEMP_PATH = re.compile(re.escape(tempfile.gettempdir().rstrip("/")) + r"/[^\s'\"():,\]]+")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


def error_signature(text: str) -> str:
    """`text` with what differs from rank to rank in one and the same error replaced by placeholders:
    temp paths, hex addresses, and every number (rank ids, pids, ports, tensor values, sizes)."""
    text = _TEMP_PATH.sub("<tmp>", text)
    text = _ADDRESS.sub("0x?", text)
    return _NUMBER.sub("#", text)


def _group(texts: dict[int, str]) -> list[tuple[str, list[int]]]:
    """Ranks whose texts are the same error, each group shown by its lowest rank's text."""
    grouped: dict[str, tuple[str, list[int]]] = {}
    for rank in sorted(texts):
        grouped.setdefault(error_signature(texts[rank]), (texts[rank], []))[1].append(rank)
    return list(grouped.values())


def _section(text: str, ranks: list[int], texts: dict[int, str]) -> str:
    """One merged failure: the ranks, the representative text, and which ranks' texts vary from it."""
    varied = [r for r in ranks[1:] if texts[r] != text]
    verb = "differs" if len(varied) == 1 else "differ"
    note = (f"(rank {ranks[0]}'s shown; {ranks_label(varied)} {verb} only in numbers, addresses or temp paths)\n"
            if varied else "")
    return f"{'_' * 20} {ranks_label(ranks)} {'_' * 20}\n{note}{text.rstrip()}"


def _failure(run: PoolRun, failed: dict[int, RankReply], world_size: int,
             figures: dict[int, dict[str, Any]], style: str) -> Verdict:
    # A rank that died is the cause; survivors' "Connection closed by peer" errors are the symptom,
    # so the dead come first in the headline.
    crashed = sorted(r for r, e in run.ends.items() if e.kind == "crashed")
    hung = sorted(r for r, e in run.ends.items() if e.kind == "hung")
    causes: list[str] = []
    if crashed:
        causes.append("; ".join(f"rank {r} died ({run.ends[r].detail})" for r in crashed))
    first = -1
    if failed:
        # the earliest failure is the likeliest cause; later ones are often its echo
        first = next((r for r in run.arrival if r in failed), min(failed))
        # shown as its merged group is shown: by the group's lowest rank, whichever rank came first
        signature = error_signature(failed[first].message)
        first = min(r for r, reply in failed.items() if error_signature(reply.message) == signature)
        alike = sorted(r for r, reply in failed.items() if error_signature(reply.message) == signature)
        causes.append(f"{ranks_label(alike)} failed: {_clip(failed[first].message)}")
        others = sorted(set(failed) - set(alike))
        if others:
            causes.append(f"{ranks_label(others)} failed after {'it' if len(alike) == 1 else 'them'} (below)")
    if hung:
        reason = "timed out" if run.timed_out else "stuck after another rank failed"
        causes.append(f"{ranks_label(hung)} {reason}")
        diagnosis = diagnose_hang({r: run.ends[r].stack for r in hung})
        if diagnosis and not crashed and not failed:
            causes.insert(0, diagnosis)
    failing = sorted(set(failed) | set(run.ends))
    headline = f"{len(failing)} of {world_size} ranks failed: " + "; ".join(causes)
    sections: list[str] = []
    for rank in crashed:
        sections.append(f"{'_' * 20} {ranks_label([rank])} {'_' * 20}\n{_crash_text(run.ends[rank])}")

    # when a rank died, the others' errors are its echo ("Connection closed by peer"): keep them short
    def shown(reply: RankReply) -> str:
        return (reply.shortrepr if crashed else reply.longrepr) or reply.message

    texts = {r: shown(rep) for r, rep in failed.items()}
    sections.extend(_section(text, ranks, texts) for text, ranks in _group(texts))
    sections.extend(_stuck_sections([run.ends[rank] for rank in hung], style))
    exc_type, message = (failed[first].exc_type, failed[first].message) if failed else (None, "")
    return Verdict(FAILED, headline=headline, body="\n".join(sections), failing_ranks=failing,
                   figures=figures, exc_type=exc_type, message=message,
                   location=failed[first].location if failed else "", died=causes[0] if crashed else "")


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _frames(stack: str) -> list[tuple[str, int, str]]:
    """faulthandler frames of the main thread, innermost first: (path, line, function)."""
    main = stack.split("\n\n")[0] if "Current thread" in stack else stack
    return [(m["path"], int(m["line"]), m["func"]) for m in _FRAME.finditer(main)]


def _collective(frames: list[tuple[str, int, str]]) -> str | None:
    for path, _, func in frames:
        if path.endswith("distributed_c10d.py"):
            return func
    return None


def _user_frame(frames: list[tuple[str, int, str]]) -> str:
    for path, line, func in frames:
        if "site-packages" not in path and "/ddp_conformance/" not in path and not path.startswith("<"):
            return f"{func} at {path.rsplit('/', 1)[-1]}:{line}"
    return "unknown"


def diagnose_hang(stacks: dict[int, str]) -> str:
    """Name the cause of a hang from the ranks' stacks: ranks waiting in different collectives, or
    some ranks waiting in a collective that others never reached."""
    where = {rank: _frames(stack) for rank, stack in stacks.items() if stack}
    if len(where) < 2:
        return ""
    waiting = {rank: _collective(frames) for rank, frames in where.items()}
    in_collective = {rank: name for rank, name in waiting.items() if name}
    elsewhere = sorted(rank for rank, name in waiting.items() if not name)
    if in_collective and elsewhere:
        names = sorted(set(in_collective.values()))
        return (f"{ranks_label(elsewhere)} never reached the collective "
                f"({'; '.join(_user_frame(where[r]) for r in elsewhere)}) "
                f"that {ranks_label(sorted(in_collective))} "
                f"{'waits' if len(in_collective) == 1 else 'wait'} in ({', '.join(names)})")
    if len(set(in_collective.values())) > 1:
        parts = ", ".join(f"rank {r} in {name}" for r, name in sorted(in_collective.items()))
        return f"mismatched collectives: {parts}"
    return ""


OUTPUT_HEAD_LINES = 50  # how a rank's output starts (setup, the first warnings)
OUTPUT_TAIL_LINES = 150  # and what it printed last, nearest the failure
OUTPUT_LINE_CHARS = 2000


def cap_output(text: str) -> list[str]:
    """A rank's output as lines, at most head + tail of them with a marker saying how many were cut
    between, each line at most OUTPUT_LINE_CHARS long."""
    lines = text.splitlines()
    if len(lines) > OUTPUT_HEAD_LINES + OUTPUT_TAIL_LINES + 1:
        cut = len(lines) - OUTPUT_HEAD_LINES - OUTPUT_TAIL_LINES
        lines = [*lines[:OUTPUT_HEAD_LINES], f"... {cut} lines cut ...", *lines[-OUTPUT_TAIL_LINES:]]
    return [line if len(line) <= OUTPUT_LINE_CHARS
            else f"{line[:OUTPUT_LINE_CHARS]}... ({len(line) - OUTPUT_LINE_CHARS} characters cut)" for line in lines]


def prefixed_output(run: PoolRun) -> str:
    """The ranks' captured output, each line prefixed by its rank, each rank's capped (`cap_output`)."""
    return "\n".join(f"[rank {rank}] {line}" for rank in sorted(run.output) for line in cap_output(run.output[rank]))


class DistributedTestFailure(Exception):
    """Raised in the parent when ranks failed; its report is the verdict, not this traceback.
    `rank_exc_type` and `rank_message` are the first failing rank's exception, for hooks that read
    what the ranks raised (the conformance report takes a check's verdict from them)."""

    verdict_text = ""
    verdict: Verdict | None = None
    rank_exc_type: tuple[str, str] | None = None
    rank_message = ""
    rank_died = ""  # `Verdict.died`


def failure_exception(verdict: Verdict) -> DistributedTestFailure:
    """The parent's exception for a failed distributed test. Where the ranks' exception class can be
    found here, the failure is also an instance of it, so `xfail(raises=ValueError)` and
    `pytest.raises`-style expectations see the type the ranks raised."""
    text, exc_type = verdict.render(), verdict.exc_type
    cls: type[DistributedTestFailure] = DistributedTestFailure
    if exc_type is not None:
        target: Any = sys.modules.get(exc_type[0])
        for part in exc_type[1].split("."):
            target = getattr(target, part, None)
        if isinstance(target, type) and issubclass(target, Exception) and target is not Exception:
            try:
                cls = type(target.__name__, (DistributedTestFailure, target), {})
            except TypeError:
                cls = DistributedTestFailure
    try:
        failure = Exception.__new__(cls)
        Exception.__init__(failure, text.splitlines()[0] if text else "")
    except Exception:
        failure = DistributedTestFailure(text.splitlines()[0] if text else "")
    failure.verdict_text, failure.verdict = text, verdict
    failure.rank_exc_type, failure.rank_message, failure.rank_died = exc_type, verdict.message, verdict.died
    return failure
