"""The docs agree with the tree: ARCHITECTURE.md's module table names every module under
mlx_dspark/ and only paths that exist, every relative Markdown link in README.md,
ARCHITECTURE.md and docs/ points at a file that exists, and the reference docs name no
machine's own paths."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~)")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
DOCS_MENTION = re.compile(r"(?<![\w/.-])docs/[\w/.-]+\.md\b")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home)/")


def reference_docs() -> list[Path]:
    return [ROOT / "README.md", ARCHITECTURE, *sorted((ROOT / "docs").glob("*.md"))]


def all_docs() -> list[Path]:
    return reference_docs() + sorted((ROOT / "docs" / "history").glob("*.md"))


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


# ---------------------------------------------------------------------------------------------
# ARCHITECTURE.md's module table


def cell_paths(cell: str, where: str = "") -> list[str]:
    """The paths a module-table cell names in backticks. A bare file name (``toy.py``) is in
    the folder of the path before it in the same cell (``testkit/synthetic.py``,
    ``toy.py``); backticked words that are not paths (``mlx_dspark.converter``) are ignored."""
    folder, paths = None, []
    for token in CODE_SPAN.findall(cell):
        token = token.strip()
        if "/" in token:
            paths.append(token)
            folder = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
        elif token.endswith(".py"):
            assert folder is not None, f"{where}: {token!r} has no folder before it in its cell"
            paths.append(folder + token)
    return paths


def module_table() -> list[tuple[int, list[str]]]:
    """(line number, paths of its first cell) per row of the table under "## Modules"."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "## Modules"), None)
    assert start is not None, "ARCHITECTURE.md: no '## Modules' section"
    rows = []
    for n, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line.strip()) <= set("|-: "):
            continue
        paths = cell_paths(line.strip().strip("|").split("|")[0], f"ARCHITECTURE.md:{n}")
        if paths:
            rows.append((n, paths))
    assert rows, "ARCHITECTURE.md: no module table under '## Modules'"
    return rows


def test_module_table_lists_only_paths_that_exist():
    missing = [f"ARCHITECTURE.md:{n}: {p}" for n, paths in module_table() for p in paths
               if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, "the module table lists paths that do not exist:\n" + "\n".join(missing)


def test_module_table_lists_each_path_once():
    seen: dict[str, int] = {}
    twice = []
    for n, paths in module_table():
        for p in paths:
            if p in seen:
                twice.append(f"ARCHITECTURE.md:{n}: {p} (also line {seen[p]})")
            seen.setdefault(p, n)
    assert not twice, "the module table lists a path twice:\n" + "\n".join(twice)


def test_module_table_lists_every_module_of_the_package():
    listed = {p for _, paths in module_table() for p in paths}
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "mlx_dspark").rglob("*.py")
                     if "__pycache__" not in p.parts)
    unlisted = [m for m in modules if m not in listed]
    assert not unlisted, ("modules missing from ARCHITECTURE.md's module table (add a row "
                          "saying what each holds):\n" + "\n".join(unlisted))


def test_a_cell_may_name_several_files_of_one_folder():
    assert cell_paths("`testkit/synthetic.py`, `toy.py` (`testkit`)") \
        == ["testkit/synthetic.py", "testkit/toy.py"]
    assert cell_paths("`converter/` (`mlx_dspark.converter`)") == ["converter/"]


# ---------------------------------------------------------------------------------------------
# Links


def relative_links(doc: Path) -> list[tuple[int, str]]:
    """(line number, target) of each Markdown link to a relative path (anchor dropped)."""
    out = []
    for n, line in prose(doc.read_text()):
        line = CODE_SPAN.sub("", line)
        targets = INLINE_LINK.findall(line)
        m = REFERENCE_LINK.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
                continue                      # a URL (http:, mailto:) or an anchor on the page
            out.append((n, target.split("#", 1)[0].split("?", 1)[0]))
    return out


def test_every_relative_link_in_the_docs_points_at_a_file_that_exists():
    broken = []
    for doc in all_docs():
        for n, target in relative_links(doc):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}:{n}: ({target})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_path_named_in_the_docs_exists():
    # Paths written out in prose or code spans ("docs/serve.md"), relative to the repository.
    broken = []
    for doc in all_docs():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in DOCS_MENTION.findall(line):
                if not (ROOT / path).exists():
                    broken.append(f"{doc.relative_to(ROOT)}:{n}: {path}")
    assert not broken, "docs name files that do not exist:\n" + "\n".join(broken)


def test_the_link_reader_finds_links_and_skips_urls_anchors_and_code(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See [a](a.md#part), [web](https://x.org/b.md), [top](#top),\n"
                   "`[not](code.md)` and ![img](pics/i.png \"title\").\n"
                   "```\n[fenced](fenced.md)\n```\n"
                   "[ref]: ref/r.md\n")
    assert relative_links(doc) == [(1, "a.md"), (2, "pics/i.png"), (6, "ref/r.md")]


# ---------------------------------------------------------------------------------------------
# Machine paths


def test_reference_docs_name_no_machine_paths():
    found = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}" for doc in reference_docs()
             for n, line in enumerate(doc.read_text().splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not found, ("paths of one machine in the docs (write a placeholder such as DIR):\n"
                       + "\n".join(found))


# ---------------------------------------------------------------------------------------------
# README's size and the docs index (issue 41)


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_is_at_most_250_lines_and_1500_words():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250 and len(text.split()) <= 1500, \
        (len(text.splitlines()), len(text.split()))


def test_the_pypi_warning_comes_in_the_quick_start_before_its_first_command():
    quick = readme_section("Quick start")
    assert "PyPI" in quick and quick.index("PyPI") < quick.index("```")


def test_docs_readme_indexes_every_doc():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target).resolve() for _, target in relative_links(index)}
    pages = [p for p in (ROOT / "docs").rglob("*.md") if p != index]
    missing = sorted(str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked)
    assert not missing, "docs/README.md does not link:\n" + "\n".join(missing)


def test_the_real_model_on_a_mac_gives_memory_per_format_speeds_and_the_bench_command():
    mac = readme_section("The real model on a Mac")
    for fmt in ("NVFP4", "4-bit", "8-bit", "bf16"):
        assert re.search(rf"\| {fmt}\b[^\n]*\| [\d.]+ GB \|", mac), fmt
    assert "computed" in mac and "docs/real-model.md" in mac
    assert "M5 Max" in mac and "https://github.com/Blaizzy/mlx-vlm/pull/2145" in mac
    assert "mlx-dspark bench --model" in mac
