"""Read a pytest run's JUnit XML and fail where a green exit code would hide that nothing was proven.

    python .ci/tally.py RUN.xml                  # at least one test passed, none failed
    python .ci/tally.py RUN.xml --like REF.xml   # ... and every test passed here as often as in REF

pytest exits 0 when every test skips, and a test that skips only on some torch (an import that is not
there, a feature detected as absent) would turn a job on that torch green without running it. So the
floor and newest-torch jobs are held to the first job's default run: the same tests, passed, not skipped.
One line per run says what ran; every skip reason is printed with its count.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | skipped | failed, the skip or failure message)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message", "")
        found[test] = (outcome, message)
    return found


def passed_per_test(run: dict[str, tuple[str, str]]) -> Counter[str]:
    """How many cases of each test function passed. By function, not by id: pytest's ids for some
    parameters differ between releases (pytest 9 shortens long strings to `reason0`, pytest 8 does not)."""
    return Counter(test.split("[", 1)[0] for test, (outcome, _) in run.items() if outcome == "passed")


def problems(run: dict[str, tuple[str, str]], like: dict[str, tuple[str, str]] | None) -> list[str]:
    counts = Counter(outcome for outcome, _ in run.values())
    found = [f"{test}: {message}" for test, (outcome, message) in run.items() if outcome == "failed"]
    if not counts["passed"]:
        found.append("no test passed (an empty or all-skipped run proves nothing)")
    if like is not None:
        here = passed_per_test(run)
        for test, expected in passed_per_test(like).items():
            if here[test] < expected:
                why = sorted({m for t, (o, m) in run.items() if t.split("[", 1)[0] == test and o != "passed"})
                found.append(f"{test}: {expected} passed in the reference run, {here[test]} here {why or ''}".rstrip())
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--like", type=Path, help="a reference run whose passed tests must all pass here")
    args = parser.parse_args()
    run = outcomes(args.junit)
    counts = Counter(outcome for outcome, _ in run.values())
    print(f"tally {args.junit.name}: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed")
    for reason, count in Counter(message for outcome, message in run.values() if outcome == "skipped").items():
        print(f"  skipped x{count}: {reason}")
    found = problems(run, outcomes(args.like) if args.like else None)
    for line in found:
        print(f"tally: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
