"""Every relative link in every Markdown file of the repository resolves, and every
file or module of the project a document names in a code span exists.

A link is checked the way GitHub renders it: the path is relative to the file that holds
it, must exist inside the repository, and a ``#fragment`` must name a heading of the
target Markdown file (GitHub's anchor rule: lower case, punctuation dropped, spaces to
hyphens, ``-1``, ``-2`` … for repeated headings). Links inside code blocks and code spans
are not links, and are not checked. Absolute URLs are not fetched (the tests run offline).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from itertools import pairwise
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

REPO_ROOT = Path(__file__).resolve().parents[2]
# Directories that are not the project's own documents: environments, build output,
# caches, and vendored packages.
SKIPPED_DIRS = {".git", ".venv", "node_modules", "build", "dist", "__pycache__"}

_parser = MarkdownIt("commonmark").enable("table")


def markdown_files() -> list[Path]:
    found: list[Path] = []
    for path in sorted(REPO_ROOT.rglob("*.md")):
        parts = path.relative_to(REPO_ROOT).parts
        if any(part in SKIPPED_DIRS or part.startswith(".") or part.endswith(".egg-info")
               for part in parts[:-1]):
            continue
        found.append(path)
    return found


def _walk(tokens: list[Token]) -> Iterator[Token]:
    for token in tokens:
        yield token
        if token.children:
            yield from _walk(token.children)


def links_of(path: Path) -> list[str]:
    """The link and image targets of one Markdown file, in document order."""
    targets: list[str] = []
    for token in _walk(_parser.parse(path.read_text(encoding="utf-8"))):
        if token.type == "link_open":
            targets.append(str(token.attrGet("href") or ""))
        elif token.type == "image":
            targets.append(str(token.attrGet("src") or ""))
    return targets


def _plain_text(inline: Token) -> str:
    return "".join(child.content for child in _walk(inline.children or [])
                   if child.type in ("text", "code_inline"))


def github_slug(text: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return slug.replace(" ", "-")


@cache
def anchors_of(path: Path) -> frozenset[str]:
    """The fragment names GitHub gives the headings of one Markdown file."""
    tokens = _parser.parse(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for opening, inline in pairwise(tokens):
        if opening.type != "heading_open":
            continue
        slug = github_slug(_plain_text(inline))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    # Explicit HTML anchors (<a id="…"> / name="…") are targets too.
    anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", path.read_text("utf-8")))
    return frozenset(anchors)


def broken_links(path: Path, root: Path = REPO_ROOT) -> list[str]:
    problems: list[str] = []
    for target in links_of(path):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or target.startswith("//"):
            continue  # an absolute URL: not checked offline
        if not parts.path and not parts.fragment:
            problems.append(f"{target!r}: empty link")
            continue
        resolved = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not resolved.is_relative_to(root):
            problems.append(f"{target!r}: points outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{target!r}: {resolved.relative_to(root)} does not exist")
            continue
        fragment = unquote(parts.fragment).lower()
        if fragment and resolved.suffix == ".md" and fragment not in anchors_of(resolved):
            problems.append(f"{target!r}: no heading #{parts.fragment} in "
                            f"{resolved.relative_to(root)}")
    return problems


def test_the_repository_has_markdown_to_check() -> None:
    names = {path.relative_to(REPO_ROOT).as_posix() for path in markdown_files()}
    assert {"README.md", "CHANGELOG.md"} <= names


@pytest.mark.parametrize(
    "path", markdown_files(), ids=lambda path: path.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_reports_a_missing_file_a_missing_heading_and_an_escape(
        tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "other.md").write_text("# Set up `kvtether` — fast!\n\n## Usage\n## Usage\n")
    doc = root / "doc.md"
    doc.write_text(
        "[ok](other.md) [ok](other.md#set-up-kvtether--fast) [ok](other.md#usage-1)\n"
        "[ok](#title) ![ok](other.md) [web](https://example.com/x.md)\n"
        "`[code](nowhere.md)`\n\n    [indented code](nowhere.md)\n\n"
        "# Title\n\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [escape](../outside.md)\n")
    assert broken_links(doc, root=root) == [
        "'missing.md': missing.md does not exist",
        "'other.md#nope': no heading #nope in other.md",
        "'../outside.md': points outside the repository",
    ]


# Code spans that name the project's own files and modules: `sidecar/runtime/decider.py`,
# `sidecar.api.toolcalls.command_key`. Refactors move code; the docs must follow.
_PATH_SPAN = re.compile(r"(?:sidecar|vllm_plugin|benchmarks|tests|scripts|deploy|proto)/[\w./-]+")
_MODULE_SPAN = re.compile(r"(?:sidecar|vllm_plugin|benchmarks)(?:\.\w+)+")
_FILE_SUFFIXES = (".md", ".py", ".json", ".yaml", ".yml", ".png", ".txt", ".sh")
# History names things as they were at its commits: the changelog and the decision
# records are not held to today's tree.
_HISTORY = ("CHANGELOG.md", "docs/decisions/")


def code_spans(path: Path) -> list[str]:
    return [token.content for token in _walk(_parser.parse(path.read_text(encoding="utf-8")))
            if token.type == "code_inline"]


def missing_code_names(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """Paths and dotted names in ``path``'s code spans that name nothing in ``root``."""
    problems: list[str] = []
    for span in code_spans(path):
        if _PATH_SPAN.fullmatch(span):
            if not (root / span).exists():
                problems.append(f"`{span}`: no such file or folder")
        elif _MODULE_SPAN.fullmatch(span) and not span.endswith(_FILE_SUFFIXES):
            problem = _missing_dotted(span, root)
            if problem:
                problems.append(f"`{span}`: {problem}")
    return problems


def _missing_dotted(name: str, root: Path) -> str | None:
    parts = name.split(".")
    module = root / parts[0]
    depth = 1
    while depth < len(parts):
        package, source = module / parts[depth], module / f"{parts[depth]}.py"
        if package.is_dir():
            module = package
        elif source.exists():
            module = source
        else:
            break
        depth += 1
    if depth == 1:
        return f"no module {parts[0]}.{parts[1]}"
    attributes = parts[depth:]
    if not attributes:
        return None
    text = (module / "__init__.py" if module.is_dir() else module).read_text("utf-8")
    # One attribute deep is checked: a name defined or imported in that module.
    if not re.search(rf"\b(?:def|class)\s+{attributes[0]}\b|\b{attributes[0]}\b\s*[:=]|"
                     rf"import[^\n]*\b{attributes[0]}\b", text):
        return f"{'.'.join(parts[:depth])} defines no {attributes[0]}"
    return None


@pytest.mark.parametrize(
    "path", [path for path in markdown_files()
             if not path.relative_to(REPO_ROOT).as_posix().startswith(_HISTORY)],
    ids=lambda path: path.relative_to(REPO_ROOT).as_posix())
def test_every_file_and_module_a_document_names_exists(path: Path) -> None:
    assert missing_code_names(path) == []


def test_the_name_check_reports_a_moved_file_module_and_attribute(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "sidecar" / "api").mkdir(parents=True)
    (root / "sidecar" / "__init__.py").write_text("")
    (root / "sidecar" / "api" / "__init__.py").write_text("")
    (root / "sidecar" / "api" / "toolcalls.py").write_text("def command_key(x):\n    ...\n")
    doc = root / "doc.md"
    doc.write_text("`sidecar/api/toolcalls.py` `sidecar.api.toolcalls.command_key` "
                   "`sidecar.api` `sidecar/toolcalls.py` `sidecar.toolcalls.command_key` "
                   "`sidecar.api.toolcalls.parse` `python -m sidecar.cli` `sidecar.md`\n")
    assert missing_code_names(doc, root=root) == [
        "`sidecar/toolcalls.py`: no such file or folder",
        "`sidecar.toolcalls.command_key`: no module sidecar.toolcalls",
        "`sidecar.api.toolcalls.parse`: sidecar.api.toolcalls defines no parse",
    ]
