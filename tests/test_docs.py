"""The docs stay what they claim: a short README, links and paths that resolve, and a mutant catalogue
that names exactly the fixtures there are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ddp_conformance.selection import CHECK_IDS, DEFAULT_CHECKS

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT_BYTES = 15 * 1024
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "RESULTS.md",
               *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "checks").glob("*.md")])
MUTANTS = ROOT / "fixtures" / "mutants"
CATALOGUE_HEADING = "## Proof that the checks can fail: the mutant catalogue"
# repository paths a doc names in backticks, checked to exist (a folder ends with "/")
REPO_PATH = re.compile(r"`((?:\.ci|benchmarks|ddp_conformance|docs|examples|fixtures|tests)/[\w./-]*)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_readme_is_at_most_15_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes, over {README_LIMIT_BYTES}: move prose to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL: not checked offline
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{_name(doc)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_repository_path_named_exists(doc: Path):
    named = {path for path in REPO_PATH.findall(doc.read_text()) if not re.search(r"[*{<]", path)}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{_name(doc)} names paths that do not exist: {missing}"


def _catalogue() -> str:
    text = (ROOT / "docs" / "checks.md").read_text()
    assert CATALOGUE_HEADING in text, f"docs/checks.md has no section {CATALOGUE_HEADING!r}"
    return text.split(CATALOGUE_HEADING, 1)[1].split("\n## ", 1)[0]


def _outside_parentheses(cell: str) -> str:
    """A catalogue cell's fixture names, without the description in parentheses that follows each."""
    while (stripped := re.sub(r"\([^()]*\)", "", cell)) != cell:
        cell = stripped
    return cell


def test_the_mutant_catalogue_names_every_fixture_and_only_those():
    rows = [line.split("|")[1] for line in _catalogue().splitlines()
            if line.startswith("| ") and not line.startswith("| mutant |")]
    named = {name for cell in rows for name in re.findall(r"`(\w+)`", _outside_parentheses(cell))}
    fixtures = {path.stem for path in MUTANTS.glob("*.py")}
    assert named - fixtures == set(), f"docs/checks.md names fixtures that do not exist: {sorted(named - fixtures)}"
    assert fixtures - named == set(), f"fixtures missing from docs/checks.md's catalogue: {sorted(fixtures - named)}"


def test_every_fixture_the_checks_pages_cite_exists():
    pages = [ROOT / "docs" / "checks.md", *(ROOT / "docs" / "checks").glob("*.md")]
    text = "\n".join(page.read_text() for page in pages)
    cited = {name for phrase in re.findall(r"fixtures? ((?:`\w+`(?:, | and |, and )?)+)", text)
             for name in re.findall(r"`(\w+)`", phrase)}
    known = {path.stem for path in (ROOT / "fixtures").glob("*/*.py")}
    assert cited, "the checks' pages cite no fixture by name"
    assert cited <= known, f"the checks' pages cite fixtures that do not exist: {sorted(cited - known)}"


#: a check page's lists of the fixtures that prove it, each line "- LABEL: `a`, `b`", in this order
FIXTURE_LISTS = {"breaks": "must fail it",
                 "breaks_on_cuda": "must fail it on a GPU (on a CPU it cannot judge them)",
                 "controls": "correct in an unusual way, must pass it",
                 "skips": "cannot be judged by it, and skips saying why"}
FIXTURES_HEADING = "## The fixtures that prove it"


def fixtures_proving(check: str) -> dict[str, list[str]]:
    """What the fixtures declare of `check` (`tests/checks/test_suite.py` holds each to it): those that break it, on
    every device or on a GPU only; the controls it concerns; those it cannot judge."""
    from tests.checks.test_suite import declared  # deferred: test_suite imports the checks

    found: dict[str, list[str]] = {key: [] for key in FIXTURE_LISTS}
    for path in sorted(MUTANTS.glob("*.py")):
        if declared(path, "CONTROL", ""):
            if check in set(declared(path, "CONCERNS", DEFAULT_CHECKS)):
                found["controls"].append(path.stem)
            continue
        if check in declared(path, "BREAKS"):
            found["breaks"].append(path.stem)
        elif check in declared(path, "BREAKS_ON_CUDA", set()):
            found["breaks_on_cuda"].append(path.stem)
        if check in declared(path, "SKIPS", {}):
            found["skips"].append(path.stem)
    return found


def check_page_fixtures(found: dict[str, list[str]]) -> str:
    """The section a check page ends with, listing `fixtures_proving`'s fixtures."""
    catalogue = "../checks.md#proof-that-the-checks-can-fail-the-mutant-catalogue"
    lines = [FIXTURES_HEADING, "", f"In `fixtures/mutants/` ([the catalogue]({catalogue}) says what each gets wrong); "
             "`tests/checks/test_suite.py` holds each to what it declares.", ""]
    lines += [f"- {label}: " + (", ".join(f"`{name}`" for name in found[key]) or "none")
              for key, label in FIXTURE_LISTS.items()]
    return "\n".join(lines)


@pytest.mark.parametrize("check", CHECK_IDS)
def test_each_check_has_a_page_that_lists_the_fixtures_proving_it(check: str):
    """docs/checks/<id>.md ends with the fixtures that prove the check, as they declare it; docs/checks.md and
    README's table link it."""
    text = (ROOT / "docs" / "checks" / f"{check}.md").read_text()
    assert text.startswith(f"# {check}"), f"docs/checks/{check}.md does not begin with its id"
    assert FIXTURES_HEADING in text, f"docs/checks/{check}.md has no section {FIXTURES_HEADING!r}"
    section = FIXTURES_HEADING + text.split(FIXTURES_HEADING, 1)[1].split("\n## ", 1)[0]
    assert section.rstrip() == check_page_fixtures(fixtures_proving(check))
    for index in ("docs/checks.md", "README.md"):
        assert f"[`{check}`]({'checks/' if index.startswith('docs') else 'docs/checks/'}{check}.md)" in (
            ROOT / index).read_text(), f"{index} does not link {check}'s page"


def test_the_architecture_doc_shows_the_tree():
    """docs/architecture.md draws every file of the package, each under its folder, and nothing else."""
    package = ROOT / "ddp_conformance"
    tree = re.search(r"```text\n(.*?)```", (ROOT / "docs" / "architecture.md").read_text(), flags=re.S)
    assert tree is not None
    shown: set[str] = set()
    folders: list[str] = []
    for line in tree.group(1).splitlines()[1:]:
        match = re.match(r"^((?:│   |    )*)[├└]── (\S+)", line)
        if match is None:
            continue
        depth, name = len(match.group(1)) // 4, match.group(2)
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            shown.add("/".join([*folders, name]))
    actual = {str(path.relative_to(package)) for pattern in ("*.py", "*.json") for path in package.rglob(pattern)}
    assert shown == actual


VERDICTS_HEADING = "## Every verdict, with its fix"
QUOTED = re.compile(r'"([^"]+)"')


def _literal_text(paths: list[Path]) -> list[str]:
    """Every string literal of these sources, an f-string's literal parts each on its own."""
    found: list[str] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
    return found


def verdict_bullets(text: str) -> list[str]:
    """The bullets of a page's verdict section, each with its continuation lines joined."""
    section = text.split(VERDICTS_HEADING, 1)[1].split("\n## ", 1)[0]
    bullets: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            bullets.append(line[2:])
        elif line.startswith("  ") and bullets:
            bullets[-1] += " " + line.strip()
    return bullets


@pytest.mark.parametrize("check", CHECK_IDS)
def test_each_check_page_lists_its_verdicts_in_the_code_s_words_each_with_its_fix(check: str):
    """Each verdict on docs/checks/<id>.md opens with words the check's code writes (quoted, verbatim: a page
    cannot promise a verdict the code never gives), says whether it fails or skips, and gives the fix."""
    text = (ROOT / "docs" / "checks" / f"{check}.md").read_text()
    assert VERDICTS_HEADING in text, f"docs/checks/{check}.md has no section {VERDICTS_HEADING!r}"
    literals = _literal_text(sorted((ROOT / "ddp_conformance" / "checks").rglob("*.py")))
    bullets = verdict_bullets(text)
    assert bullets, f"docs/checks/{check}.md lists no verdict"
    for bullet in bullets:
        quoted = QUOTED.findall(bullet)
        assert quoted, f"{check}: a verdict without the code's words: {bullet[:80]!r}"
        assert bullet.startswith(("**Fails:**", "**Skips:**")), f"{check}: fails or skips? {bullet[:80]!r}"
        assert "**Fix:**" in bullet, f"{check}: a verdict without its fix: {bullet[:80]!r}"
        unknown = [q for q in quoted if not any(q in literal for literal in literals)]
        assert unknown == [], f"{check}: words no check writes: {unknown}"
