"""Print pip constraints pinning every dependency of pyproject.toml to the oldest version it admits.

CI installs with these to prove that the declared floors are tested floors, torch's too: its floor is
a CUDA build (only 2.13.0 has a CPU build on the registry), which installs and runs on a CPU machine.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][^,;\s]*)")


def floors(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = FLOOR.match(requirement)
        if match is None:
            sys.exit(f"{pyproject}: {requirement!r} has no '>=' floor; CI tests every declared floor")
        pins[match.group(1).lower()] = match.group(2)
    return pins


if __name__ == "__main__":
    for name, version in sorted(floors(Path(sys.argv[1])).items()):
        print(f"{name}=={version}")
