"""The README's tour runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_tour_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_first_commands_are_the_ci_commands() -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert commands[0].strip() == "bash scripts/setup.sh && .venv/bin/kvlifecycle demo"
    assert commands[1].strip() == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (root / ".ci" / "run").read_text()


ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub renders for ``page``: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


def _broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...: not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.relative_to(root)}: {target} (no {path})")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{page.relative_to(root)}: {target} (no heading #{anchor} in {path or page.name})")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    pages = _pages()
    assert len(pages) > 5
    assert [b for page in pages for b in _broken_links(page)] == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A heading, with `code`\n\n## Twice\n\n## Twice\n")
    page.write_text("[ok](other.md#a-heading-with-code) [ok](other.md#twice-1) [gone](missing.md) "
                    "[bad](other.md#nowhere) [web](https://example.org/x.md)\n```\n[in code](nowhere.md)\n```\n")
    assert _broken_links(page, root=tmp_path) == ["page.md: missing.md (no missing.md)",
                                                  "page.md: other.md#nowhere (no heading #nowhere in other.md)"]


def test_the_layout_table_names_every_top_level_part_and_each_path_exists() -> None:
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    paths = re.findall(r"^\| `([^`]+)` \|", layout, re.M)
    assert {"kvlifecycle/", "kvlifecycle/cli/", "kvlifecycle/tools/", "transports/", "adapters/", "tests/", "bench/",
            "docs/"} <= set(paths)
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_reading_path_is_linked_from_the_readme_and_names_files_that_exist() -> None:
    assert "(docs/README.md)" in (ROOT / "README.md").read_text()
    path = (ROOT / "docs" / "README.md").read_text()
    named = re.findall(r"`((?:kvlifecycle|transports|adapters|tests)/[\w/.]*)`", path)
    assert len(named) > 20
    assert [n for n in named if not (ROOT / n).exists()] == []
