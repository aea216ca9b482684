"""The docs are contracts a newcomer can follow: a short README, links that resolve, a site that builds with
`mkdocs build --strict`, and no prose that points outside the repository or tells its history."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
SKIP_DIRS = {".venv", ".git", "site", "__pycache__", ".forge-store", ".forge-runs", ".forge-seeds"}
PROSE_DIRS = ("forge_core", "tasks", "flows", "bench", "scripts", "tests", "docs", "configs", "deploy")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# What points outside the repository, or reads as the project's history rather than its current contract.
FORBIDDEN = {
    "a file outside the repository": re.compile(r"DESIGN\.md|\.\./shared/|/work/"),
    "an issue number": re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE),
    "a work session": re.compile(
        r"\bsessions? \d+|\bsince session|\b(previous|earlier|later) sessions?\b|\bfit the session|\bsessions? ago",
        re.IGNORECASE,
    ),
}


def repo_files(*suffixes: str) -> list[Path]:
    found = []
    for path in REPO.rglob("*"):
        if path.suffix in suffixes and path.is_file() and not SKIP_DIRS.intersection(path.relative_to(REPO).parts):
            found.append(path)
    return sorted(found)


def markdown_files() -> list[Path]:
    return repo_files(".md")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: Path) -> set[str]:
    found, fenced = set(), False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#").strip()))
    return found


def links(markdown: Path) -> list[str]:
    """Relative link targets outside code blocks and code spans."""
    targets, fenced = [], False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            targets += [t for t in LINK.findall(re.sub(r"`[^`]*`", "", line)) if not re.match(r"[a-z]+:", t)]
    return targets


def test_readme_has_a_newcomers_length():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move detail to a page under docs/ and link it"


@pytest.mark.parametrize("markdown", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(markdown: Path):
    broken = []
    for target in links(markdown):
        path, _, anchor = target.partition("#")
        resolved = (markdown.parent / path).resolve() if path else markdown
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading with anchor #{anchor}")
    assert not broken, f"{markdown.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[fine](#title) [gone](missing.md) `[code](not-a-link.md)`\n")
    assert links(page) == ["#title", "missing.md"]
    assert anchors(page) == {"title"}


def test_no_prose_points_outside_the_repo_or_into_history():
    files = [REPO / "README.md", *markdown_files(), REPO / "pyproject.toml", REPO / "Makefile", REPO / "mkdocs.yml"]
    files += [p for p in repo_files(".py", ".yaml", ".sh") if p.relative_to(REPO).parts[0] in PROSE_DIRS]
    hits = []
    for path in dict.fromkeys(files):
        if path == Path(__file__).resolve():
            continue  # this file names the patterns
        for number, line in enumerate(path.read_text().splitlines(), 1):
            hits += [
                f"{path.relative_to(REPO)}:{number}: {what}: {line.strip()}"
                for what, pattern in FORBIDDEN.items()
                if pattern.search(line)
            ]
    assert not hits, "\n".join(hits)


def build_site(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


def test_the_site_builds_strict(tmp_path):
    built = build_site(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").exists()


def test_a_broken_link_fails_the_site_build(tmp_path):
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "grpo.md").open("a") as page:
        page.write("\n[gone](architecture.md#no-such-heading)\n")
    built = build_site(tmp_path, tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-heading" in built.stderr


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("see shared/docs/DESIGN.md section 8", "a file outside the repository"),
        ("the next runner, issue #18", "an issue number"),
        ("kept empty since session 2", "a work session"),
        ("the other variants did not fit the session", "a work session"),
    ],
)
def test_the_prose_check_sees_history_and_outside_paths(line: str, what: str):
    assert FORBIDDEN[what].search(line)
    assert not any(pattern.search("a pytest session fixture; a POSIX session") for pattern in FORBIDDEN.values())
