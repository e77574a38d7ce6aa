"""What the conformance suite costs against one plain training run of the same trainer, side by side.

    python benchmarks/suite_cost.py [--trainer SPEC ...] [--world-size 2 --world-size 4]

For each trainer and world size, one after the other, in a fresh working directory each:
  suite   `python -m pytest --pyargs ddp_conformance.suite --ddp-trainer SPEC --ddp-world-size W
          --ddp-report=...`, a fresh process: wall time with interpreter start, imports and the cold
          rank pool, and the time pytest reports for its session ("in pytest");
  plain   the same trainer trained once under `torchrun --standalone --nproc_per_node W`
          (`python -m torch.distributed.run`, torchrun's module) as a user runs it, imports and
          start included (`plain_fit.py`), for n optimizer steps: n is the resume horizon, the
          `final_step` the suite's resume_fidelity reports for that trainer and world size (the
          longest fit the suite runs, which sampler_disjointness judges too; `plan_steps` in
          plan.py: n = 3E + 1 and k = 3E - 1, with E the optimizer steps of one epoch).
It prints the headline ratio suite/plain per row against the target (<= 1.5x, the goal set for the demo
transformer at world sizes 2 and 4), and where the suite's time goes, from the report's figures (rank 0's):
each check's `check_seconds`, its share of the time spent in checks and the steps it observed
(`observed_steps`), and the session's time outside the checks (in pytest minus the summed check seconds), and
the start of every verdict that is not a pass (a cheaper suite must keep each one). The plain fit's wall is
split into start-up (interpreter, imports, rendezvous, teardown) and the fit itself (`fit_seconds`, timed
around the trainer's fit call on rank 0). A check that ended in an error of its own reports no
`check_seconds`; its test's call time (pytest's `--durations`) stands in, marked *. The last table splits the
suite's wall outside the checks by where pytest spent it (`session_table`).

Trainers (default all three): the references `torch` and `lightning`, and Lightning's own demo
`lightning:lightning.pytorch.demos.transformer:LightningTransformer` (58 MB of gradients, no glue),
for which the working directory gets `./data/wikitext-2.txt` written here: 42 lines of 34 words, so
that its `WikiText2` (one `<eos>` a line, samples of 35 tokens and the next token as target) holds 41
samples. The demo's `WikiText2` needs `requests` installed even when its file exists; without it that
trainer is left out with one line. A SPEC naming a file must give an absolute path (the runs happen
in a fresh directory). Both runs of a row see the same machine within a minute; the 1-minute load
average at the start of the row is shown, since the 2-core machine is shared.

Exit status 0 when every run gave its figures (the target is a figure, not a test; a check's verdict
does not change it), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO = "lightning:lightning.pytorch.demos.transformer:LightningTransformer"
DEFAULT_TRAINERS = ("torch", "lightning", DEMO)
DEFAULT_WORLD_SIZES = (2, 4)
TARGET_RATIO = 1.5
PLAIN_FIT = Path(__file__).resolve().with_name("plain_fit.py")
DEMO_LINES, DEMO_WORDS = 42, 34  # 42 x (34 words + <eos>) = 1470 tokens: 1470 // 35 - 1 = 41 samples
INTERRUPT_GRACE_S = 30.0  # after SIGINT, for pytest to stop its rank pools before the group is killed
VERDICT_CHARS = 200
PYTEST_TIME = re.compile(r" in ([0-9.]+)s\b")
DURATION = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+\S*::test_conformance\[(.+)\]$")


@dataclass
class Finished:
    """One child process's run: its wall time (start-up included), exit status and output."""

    wall: float
    returncode: int
    stdout: str
    stderr: str

    def tail(self, chars: int = 2000) -> str:
        """The end of its output, and the start of its stderr (where a rank's own error is)."""
        head = self.stderr[:chars] + "\n...\n" if len(self.stderr) > 2 * chars else ""
        return (self.stdout[-chars:] + "\n" + head + self.stderr[-chars:]).strip()


@dataclass
class Row:
    """One trainer at one world size: the suite, the plain fit, and what they cost."""

    spec: str
    world_size: int
    load: float
    suite: Finished | None = None
    report: dict[str, Any] | None = None
    steps: int | None = None
    plain: Finished | None = None
    fit_seconds: float | None = None
    problems: list[str] = field(default_factory=list)
    label: str = ""  # what tells rows of one trainer apart in the tables (epoch_sweep's epoch length)

    @property
    def name(self) -> str:
        name = self.spec.rpartition(":")[2] if self.spec.startswith("lightning:") else self.spec
        return f"{name} ({self.label})" if self.label else name

    @property
    def in_pytest(self) -> float | None:
        """The session's seconds as pytest's summary line gives them."""
        lines = [line for line in (self.suite.stdout if self.suite else "").splitlines() if line.strip()]
        found = PYTEST_TIME.search(lines[-1]) if lines else None
        return float(found.group(1)) if found else None

    def durations(self, phase: str) -> dict[str, float]:
        """Each check's test's seconds in one pytest phase (`--durations=0`), keyed by check."""
        checks = {r["check"] for r in self.results}
        found: dict[str, float] = {}
        for line in (self.suite.stdout if self.suite else "").splitlines():
            match = DURATION.match(line.strip())
            if match and match.group(2) == phase:
                check = next((part for part in match.group(3).split("-") if part in checks), None)
                if check is not None:
                    found[check] = found.get(check, 0.0) + float(match.group(1))
        return found

    @property
    def results(self) -> list[dict[str, Any]]:
        return list(self.report["results"]) if self.report else []

    def check_times(self) -> dict[str, tuple[float, bool]]:
        """Each check's seconds on rank 0 and whether they are its `check_seconds` figure: a check
        that skipped reports none, and its test's call time stands in for it."""
        calls = self.durations("call")
        return {r["check"]: ((float(r["figures"]["check_seconds"]), True) if "check_seconds" in r["figures"]
                             else (calls.get(r["check"], 0.0), False)) for r in self.results}

    @property
    def check_seconds(self) -> float:
        return sum(seconds for seconds, _ in self.check_times().values())

    @property
    def ratio(self) -> float | None:
        if self.suite is None or self.plain is None or self.plain.returncode != 0:
            return None
        return self.suite.wall / self.plain.wall


def run(command: list[str], cwd: Path, timeout: float) -> Finished:
    """`command` in its own process group, timed from start to exit; whatever it started is ended
    with it (SIGINT first, so pytest stops its rank pools; then SIGKILL to the group)."""
    began = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        stdout, stderr = proc.communicate()
        stderr += f"\nsuite_cost: ended after {timeout:.0f} s"
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): no child outlives the benchmark
            _end(proc)
    return Finished(time.perf_counter() - began, proc.returncode, stdout, stderr)


def _end(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=INTERRUPT_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def write_demo_data(workdir: Path) -> None:
    """The file the demo's WikiText2 reads (`./data/wikitext-2.txt`): 41 samples of 35 tokens."""
    data = workdir / "data"
    data.mkdir()
    lines = (" ".join(f"w{(line * DEMO_WORDS + word) % 997}" for word in range(DEMO_WORDS))
             for line in range(DEMO_LINES))
    (data / "wikitext-2.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_suite(row: Row, workdir: Path, timeout: float, options: Sequence[str] = ()) -> None:
    report = workdir / "report.json"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={workdir / 'tmp'}",
               "--durations=0", "--durations-min=0",
               "--pyargs", "ddp_conformance.suite", "--ddp-trainer", row.spec,
               "--ddp-world-size", str(row.world_size), f"--ddp-report={report}", *options]
    row.suite = run(command, workdir, timeout)
    if report.is_file():
        row.report = json.loads(report.read_text())
    else:
        row.problems.append(f"the suite wrote no report (exit {row.suite.returncode}):\n{row.suite.tail()}")


def resume_horizon(row: Row) -> int | None:
    """n: the final step of resume_fidelity's uninterrupted fit, from its figures."""
    for result in row.results:
        if result["check"] == "resume_fidelity" and "final_step" in result["figures"]:
            return int(result["figures"]["final_step"])
    return None


def run_plain(row: Row, workdir: Path, timeout: float, options: Sequence[str] = ()) -> None:
    assert row.steps is not None
    fit_dir = workdir / "plain"
    fit_dir.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(row.world_size), str(PLAIN_FIT), row.spec, "--steps", str(row.steps), "--workdir", str(fit_dir),
               *options]
    row.plain = run(command, workdir, timeout)
    for line in row.plain.stdout.splitlines():
        if line.startswith('{"fit_seconds"'):
            row.fit_seconds = float(json.loads(line)["fit_seconds"])
    if row.plain.returncode != 0 or row.fit_seconds is None:
        row.problems.append(f"the plain fit failed (exit {row.plain.returncode}):\n{row.plain.tail()}")


def measure(spec: str, world_size: int, timeout: float, suite_options: Sequence[str] = (),
            plain_options: Sequence[str] = ()) -> Row:
    """The suite, then the plain fit to its resume horizon; `suite_options` and `plain_options` give both the
    same settings (a precision, a device) each in its own words."""
    row = Row(spec, world_size, os.getloadavg()[0])
    with tempfile.TemporaryDirectory(prefix="suite-cost-") as tmp:
        workdir = Path(tmp)
        if spec == DEMO:
            write_demo_data(workdir)
        run_suite(row, workdir, timeout, suite_options)
        row.steps = resume_horizon(row)
        if row.steps is None:
            if row.report is not None:
                row.problems.append("resume_fidelity reported no final_step: no resume horizon to fit to")
            return row
        run_plain(row, workdir, timeout, plain_options)
    return row


def machine() -> str:
    import torch  # deferred: only for its version, after the argument check

    return (f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_table(rows: list[Row]) -> list[str]:
    out = ["| trainer | ws | load | n | suite s | in pytest s | in checks s | outside checks s | plain s "
           "| plain start-up s | plain fit s | suite/plain | target <= 1.5x |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        inside = row.in_pytest
        outside = inside - row.check_seconds if inside is not None and row.report else None
        plain = row.plain.wall if row.plain else None
        startup = plain - row.fit_seconds if plain is not None and row.fit_seconds is not None else None
        ratio = row.ratio
        verdict = "-" if ratio is None else ("met" if ratio <= TARGET_RATIO else "MISSED")
        out.append(f"| {row.name} | {row.world_size} | {row.load:.1f} | {row.steps or '-'} "
                   f"| {_s(row.suite.wall if row.suite else None)} | {_s(inside)} "
                   f"| {_s(row.check_seconds if row.report else None)} | {_s(outside)} | {_s(plain)} | {_s(startup)} "
                   f"| {_s(row.fit_seconds)} | {'-' if ratio is None else f'{ratio:.2f}x'} | {verdict} |")
    return out


def checks_table(rows: list[Row]) -> list[str]:
    out = ["| trainer | ws | check | outcome | check s | share of checks | steps observed | test call s |",
           "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        total, calls, times = row.check_seconds, row.durations("call"), row.check_times()
        for result in row.results:
            seconds, reported = times[result["check"]]
            share = f"{100 * seconds / total:.0f}%" if total else "-"
            out.append(f"| {row.name} | {row.world_size} | {result['check']} | {result['outcome']} "
                       f"| {seconds:.1f}{'' if reported else '*'} | {share} "
                       f"| {result['figures'].get('observed_steps', '-')} | {_s(calls.get(result['check']))} |")
    return out


def verdicts(rows: list[Row]) -> list[str]:
    """Every check that did not pass, with its message's start: a cheaper suite must keep them all."""
    return [f"- {row.name} at world size {row.world_size}, {r['check']} {r['outcome']}: "
            f"{textwrap.shorten(r['message'], VERDICT_CHARS, placeholder='...')}"
            for row in rows for r in row.results if r["outcome"] != "passed"]


def session_table(rows: list[Row]) -> list[str]:
    """Where a suite run's wall goes outside the checks: before pytest's session clock starts
    (interpreter, plugins), in the session outside any test (collection, session start and finish),
    in tests' setup and teardown, in the first test's call beyond its check (the cold rank pool, the
    trainer's first imports), in the other calls beyond their checks (the task's round trip to the
    ranks, the SPEC resolved in them), and in the checks."""
    out = ["| trainer | ws | suite s | before session s | session outside tests s | setup+teardown s "
           "| 1st call beyond its check s | other calls beyond checks s | in checks s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        inside, results = row.in_pytest, row.results
        if row.suite is None or inside is None or not results:
            continue
        calls = row.durations("call")
        around = sum(row.durations("setup").values()) + sum(row.durations("teardown").values())
        beyond = {check: calls.get(check, 0.0) - seconds for check, (seconds, _) in row.check_times().items()}
        first = results[0]["check"]  # the suite's order is the order its tests run in
        out.append(f"| {row.name} | {row.world_size} | {_s(row.suite.wall)} | {_s(row.suite.wall - inside)} "
                   f"| {_s(inside - sum(calls.values()) - around)} | {_s(around)} | {_s(beyond[first])} "
                   f"| {_s(sum(v for k, v in beyond.items() if k != first))} | {_s(row.check_seconds)} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", action="append", default=None,
                        help="SPEC (repeatable; default: torch, lightning and the demo transformer)")
    parser.add_argument("--world-size", action="append", type=int, default=None,
                        help="ranks (repeatable; default 2 and 4)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds for each run (default 1200)")
    args = parser.parse_args()
    trainers = args.trainer or list(DEFAULT_TRAINERS)
    world_sizes = args.world_size or list(DEFAULT_WORLD_SIZES)
    if any(w < 1 for w in world_sizes):
        parser.error(f"--world-size: expected a positive number of ranks, got {min(world_sizes)}")
    if DEMO in trainers and importlib.util.find_spec("requests") is None:
        print(f"suite_cost: {DEMO} left out: its WikiText2 needs the requests package even when its file exists "
              "(pip install requests)", file=sys.stderr)
        trainers.remove(DEMO)
    if not trainers:
        return 1
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: list[Row] = []
    for world_size in world_sizes:
        for spec in trainers:
            print(f"suite_cost: {spec} at world size {world_size} ...", file=sys.stderr, flush=True)
            rows.append(measure(spec, world_size, args.timeout))
    print(f"machine: {machine()}; began {began}; target: suite/plain <= {TARGET_RATIO:.1f}x\n")
    print("\n".join(summary_table(rows)), end="\n\n")
    print("\n".join(checks_table(rows)))
    print("\n\\* no `check_seconds` in the report (a check that ended in an error reports none): "
          "its test's call time\n")
    print("\n".join(session_table(rows)), end="\n\n")
    print("\n".join(["checks that did not pass:", *verdicts(rows)]))
    for row in rows:
        for problem in row.problems:
            print(f"\n{row.name} at world size {row.world_size}: {problem}", file=sys.stderr)
    return 1 if any(row.problems for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
