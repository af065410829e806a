"""Every relative link in README.md and docs/*.md resolves inside the repository.

A link `[text](target)` (or an image `![alt](target)`) whose target is not a
URL must name a file or folder that exists, relative to the linking file, and
stays inside the repository; an `#anchor` into a Markdown file (or a bare
`#anchor` into the linking file itself) must match a heading there, slugged
the way GitHub does it.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) or [text](target "title") or [text](<target>); the text may hold `code` and nested [..]
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\"|\s+'[^']*')?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; with `blank_code`, inline
    code spans are blanked out (same length, so `[x](y)` inside code is no link)."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif line.strip().startswith(fence):
                fence = None
            continue
        if fence is None and blank_code:
            lines.append((number, CODE_SPAN.sub(lambda m: m.group(1) + "x" * len(m.group(2)) + m.group(1), line)))
        elif fence is None:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation
    other than '-' and '_' removed, each space turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, ...) and HTML anchors."""
    found, seen = set(), {}
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text, blank_code=False):  # a heading's code spans are part of its anchor
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(HTML_ANCHOR.findall(text))
    return found


def broken_links(files: list[Path], root: Path) -> list[str]:
    """`file:line: [target] why` for every relative link in `files` that does not resolve."""
    root = root.resolve()
    broken = []
    for source in files:
        text = source.read_text(encoding="utf-8")
        for number, line in prose_lines(text):
            for match in LINK.finditer(line):
                target = match.group(1).strip("<>")
                if SCHEME.match(target):
                    continue  # http(s), mailto: not checked here
                where = f"{source.relative_to(root)}:{number}: ({target})"
                path_part, _, anchor = target.partition("#")
                path = (source.parent / path_part).resolve() if path_part else source.resolve()
                if not path.is_relative_to(root):
                    broken.append(f"{where} points outside the repository")
                elif not path.exists():
                    broken.append(f"{where} does not exist")
                elif anchor and path.suffix == ".md" and path.is_file() and anchor not in anchors(path):
                    broken.append(f"{where} has no heading with the anchor #{anchor} in {path.relative_to(root)}")
    return broken


def test_relative_links_in_readme_and_docs_resolve():
    files = doc_files(REPO)
    assert (REPO / "README.md").is_file()
    broken = broken_links(files, REPO)
    assert not broken, f"{len(broken)} broken link(s) in README.md / docs/*.md:\n" + "\n".join(broken)


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "code.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## What it saves (`bench/x.py`)\n\n## Twice\n\n## Twice\n\nback to [the top](#a-page)\n"
    )
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#what-it-saves-benchxpy) [ok](docs/page.md#twice-1) [ok](code.py)\n"
        "[ok](#title) [`code` ok](docs/) [web](https://example.com/nowhere) [mail](mailto:a@b.c)\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[not a link](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](docs/page.md#nope) [bad self](#nope) [out](../outside.md)\n"
    )
    broken = broken_links(doc_files(tmp_path), tmp_path)
    assert [b.split(": ", 1)[1].split(" ", 1)[0] for b in broken] == [
        "(missing.md)",
        "(docs/page.md#nope)",
        "(#nope)",
        "(../outside.md)",
    ], broken
    assert all(b.startswith("README.md:9: ") for b in broken), broken
