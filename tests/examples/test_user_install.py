"""A user's install, as the CI gate example does it: the workflow's own commands, in a fresh virtualenv that
already has torch (the user's environment), with only what needs this machine swapped: the plugin's source
(this checkout instead of the team's git URL or wheel), the GPU count (2) and nccl (gloo, as this machine has no
GPU). The install must leave that environment's torch as it was and bring the plugin and Lightning."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ci_gate"
WORKFLOW = EXAMPLE / ".github" / "workflows" / "ddp-conformance.yml"
# what a distribution needs in order to import, read from its metadata (extras left out)
_NAME = re.compile(r"^[A-Za-z0-9._-]+")


def _needed(name: str, seen: set[str]) -> None:
    key = name.lower().replace("_", "-")
    if key in seen:
        return
    seen.add(key)
    for requirement in metadata.requires(name) or []:
        if "extra ==" not in requirement:
            _needed(_NAME.match(requirement)[0], seen)


def torch_environment(target: Path) -> Path:
    """A folder holding this environment's torch and what it imports, as links: put on a fresh venv's path by
    a .pth file, it is the torch a user's environment already has (pip sees it installed, outside the venv, so
    it would never uninstall it: an upgrade would install a second torch inside the venv, which the test sees)."""
    names: set[str] = set()
    _needed("torch", names)
    names.discard("setuptools")  # the venv's own; pip may upgrade it there for torch's requirement
    for name in names:
        dist = metadata.distribution(name)
        tops = {Path(str(file)).parts[0] for file in dist.files or [] if not str(file).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)
    return target


def workflow_commands() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The workflow's env and its steps' (name, run) pairs, in order."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = next(iter(workflow["jobs"].values()))
    return workflow.get("env", {}), [(step.get("name", ""), step["run"]) for step in job["steps"] if "run" in step]


def _substituted(command: str, env: dict[str, str], gpus: str) -> str:
    command = re.sub(r"\$\{\{\s*env\.(\w+)\s*\}\}", lambda m: env[m[1]], command)
    return command.replace("${{ steps.gpus.outputs.count }}", gpus).replace("--ddp-backend nccl", "--ddp-backend gloo")


@pytest.mark.slow  # a fresh venv and a real install (lightning and its dependencies from the package index)
def test_the_ci_gate_workflow_installs_into_an_environment_with_torch_and_keeps_it(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy, so that the build writes nothing into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "ddp_conformance", source / "ddp_conformance",
                    ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (tmp_path / "torch_env").mkdir()
    (site / "users_torch.pth").write_text(f"{torch_environment(tmp_path / 'torch_env')}\n")

    def torch_seen() -> str:
        return subprocess.run([python, "-c", "import torch; print(torch.__version__, torch.__file__)"], check=True,
                              capture_output=True, text=True, timeout=120).stdout.strip()

    before = torch_seen()
    repo = tmp_path / "repo"  # the user's repo, as actions/checkout leaves it
    shutil.copytree(EXAMPLE, repo)
    env, steps = workflow_commands()
    env = {**env, "DDP_CONFORMANCE": f"file://{source}"}
    shell = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    shell.pop("PYTHONPATH", None)
    ran = []
    for name, command in steps:
        if "torch==" in command or "nvidia-smi" in command:
            continue  # the environment's torch is the user's; the GPU count is substituted below
        command = _substituted(command, env, gpus="2")
        done = subprocess.run(["bash", "-ec", command], cwd=repo, env=shell, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"step {name!r}: {command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ran.append(command)
    assert any("pip install" in c for c in ran) and any("ddp_conformance.suite" in c for c in ran), ran
    assert torch_seen() == before, "installing the plugin changed the environment's torch"
    report = json.loads((repo / "reports" / "ddp-conformance.json").read_text())
    assert {r["check"]: r["outcome"] for r in report["results"]}["sampler_disjointness"] == "passed", report
    assert "<property " in (repo / "reports" / "junit.xml").read_text()
