"""The repository's markdown: tables that render, links that resolve, no benchmark figure
copied into a narrative doc without its table, and the metrics reference equal to
``daemon/metrics.py``.

Every markdown file is parsed with markdown-it-py (CommonMark plus GFM tables, as GitHub
renders them). The checks work on the parser's tokens and their source line maps, so a table
row that the parser does not see as one (after a blank line or a paragraph inside the table)
is found where it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "node_modules", ".pytest_cache"}
#: Narrative docs: they link to the tables of docs/benchmarks.md instead of copying figures.
#: benchmarks.md is written by ``make bench`` and reliability.md by ``make soak``; the
#: CHANGELOG records what changed.
NARRATIVE = ["README.md", "config/README.md", "deploy/README.md", "lpcal/CLIENT.md",
             *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))
               if p.name not in {"benchmarks.md", "reliability.md"})]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def markdown_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*.md")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        out.append(path)
    return out


MD_FILES = markdown_files()
IDS = [str(p.relative_to(ROOT)) for p in MD_FILES]


@cache
def parser() -> MarkdownIt:
    return MarkdownIt("commonmark").enable("table")


@cache
def tokens(path: Path) -> list:
    return parser().parse(path.read_text())


def test_the_docs_the_issue_names_are_all_checked():
    names = set(IDS)
    for needed in ("README.md", "CHANGELOG.md", "config/README.md", "deploy/README.md",
                   "lpcal/CLIENT.md", "docs/library.md", "docs/daemon.md",
                   "docs/operations.md", "docs/development.md", "docs/scaling.md",
                   "docs/benchmarks.md"):
        assert needed in names, needed


# --------------------------------------------------------------------------- tables


def shown(path: Path) -> str:
    """``path`` as problems name it: relative to the repository (or its name, in tmp)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def cells(line: str) -> list[str]:
    """GFM table cells of one source line: split on pipes not escaped by a backslash (GFM
    splits inside code spans too), outer pipes dropped."""
    text = line.strip()
    text = text.removeprefix("|")
    if text.endswith("|") and not text.endswith("\\|"):
        text = text[:-1]
    return re.split(r"(?<!\\)\|", text)


def table_problems(path: Path) -> list[str]:
    """Rows whose cell count differs from their header's, and table-like lines (starting with
    a pipe) that the parser took for paragraph text: a table cut by a blank line or by a
    paragraph inside it."""
    lines = path.read_text().splitlines()
    problems = []
    for i, tok in enumerate(tokens(path)):
        if tok.type == "table_open":
            start, end = tok.map
            want = len(cells(lines[start]))
            for n in range(start, end):
                if n == start + 1:
                    continue  # the delimiter row (its cell count is checked by the parser)
                got = len(cells(lines[n]))
                if got != want:
                    problems.append(f"{shown(path)}:{n + 1}: {got} cells, "
                                    f"the header has {want}")
        elif tok.type == "paragraph_open":
            start, end = tok.map
            for n in range(start, end):
                if lines[n].lstrip().startswith("|"):
                    problems.append(f"{shown(path)}:{n + 1}: a table row outside "
                                    "any table (a blank line or a paragraph cut the table)")
    return problems


@pytest.mark.parametrize("path", MD_FILES, ids=IDS)
def test_every_table_row_has_its_headers_column_count(path):
    problems = table_problems(path)
    assert not problems, "\n".join(problems)


def test_table_check_finds_a_cut_table_and_a_short_row(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n\ntext\n\n"
                   "| a | b |\n|---|---|\n| 1 |\n| x \\| y | 2 |\nparagraph\n| 5 | 6 |\n")
    problems = table_problems(bad)
    assert any(":5: a table row outside" in p for p in problems), problems
    assert any(":11: 1 cells, the header has 2" in p for p in problems), problems
    assert not any(":12:" in p for p in problems), problems  # an escaped pipe is no cell
    # GFM continues a table over a following text line: it is a garbled one-cell row
    assert any(":13: 1 cells" in p for p in problems) and len(problems) == 3, problems


# --------------------------------------------------------------------------- links and anchors


def inline_text(inline) -> str:
    return "".join(c.content for c in inline.children or []
                   if c.type in ("text", "code_inline", "html_inline"))


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: lower-case; drop every character but letters, digits, spaces,
    ``-`` and ``_``; spaces become ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The heading anchors of ``path`` (repeated headings get ``-1``, ``-2``, ... as on
    GitHub), plus explicit ``<a name=...>``/``id=...`` anchors."""
    toks = tokens(path)
    seen: dict[str, int] = {}
    out = set()
    for i, tok in enumerate(toks):
        if tok.type == "heading_open":
            slug = github_slug(inline_text(toks[i + 1]))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return frozenset(out)


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line, href) of every link and image in ``path``."""
    for tok in tokens(path):
        if tok.type != "inline":
            continue
        for child in tok.children or []:
            href = child.attrs.get("href") if child.type == "link_open" else (
                child.attrs.get("src") if child.type == "image" else None)
            if href:
                yield tok.map[0] + 1 if tok.map else 0, str(href)


def link_problems(path: Path) -> list[str]:
    problems = []
    for line, href in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", href, re.IGNORECASE):  # http:, https:, mailto:
            continue
        target, _, anchor = href.partition("#")
        dest = (path.parent / target).resolve() if target else path
        where = f"{shown(path)}:{line}: {href}"
        if not dest.exists():
            problems.append(f"{where}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {target or 'itself'}")
    return problems


@pytest.mark.parametrize("path", MD_FILES, ids=IDS)
def test_relative_links_resolve_to_files_and_headings(path):
    problems = link_problems(path)
    assert not problems, "\n".join(problems)


def test_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## `[kafka]` settings\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#kafka-settings) [self](#page) "
                    "[gone](client.md) [bad anchor](other.md#nope) [web](https://x.org/y)\n")
    problems = link_problems(page)
    assert len(problems) == 2, problems
    assert "client.md does not exist" in problems[0]
    assert "#nope" in problems[1]


# --------------------------------------------------------------------------- benchmark figures

_NUM = r"\d[\d,]*(?:\.\d+)?"
#: Benchmark-like figures: multipliers with a decimal ("1.77x", "1.8 times"), per-message
#: times ("1.48 us", "0.3 µs"), throughputs ("126,000 joined samples/s", "187k msgs/s") and
#: ratios named as such ("ratio of 0.67", "0.53 of raw"). Integers such as a "5x" target or
#: a "500 ms" setting are not figures of a run.
FIGURE_PATTERNS = [
    re.compile(r"(?<![\w.])(?P<n>\d+\.\d+)\s?(?:x|×)(?![\w])"),
    re.compile(r"(?<![\w.])(?P<n>\d+\.\d+)\s+times\b"),
    re.compile(rf"(?<![\w.])(?P<n>{_NUM})\s?(?:µs|us|ns)\b"),
    re.compile(rf"(?<![\w.])(?P<n>{_NUM})\s?(?P<k>[kM])?\s?(?:joined\s+)?"
               r"(?:msgs?|messages|samples|events|rows|predictions|outcomes)/s\b"),
    re.compile(r"\bratios?\b[^.;:()]{0,30}?(?<![\w.])(?P<n>0\.\d+)"),
    re.compile(r"(?<![\w.])(?P<n>0\.\d+)\s*(?:x\s*)?(?:of|to)\s+(?:a\s+|the\s+)?raw\b"),
]
#: Figures that are not results of a benchmark run: the sizing scenario of docs/scaling.md.
ALLOWED_FIGURES = {
    "docs/scaling.md": {"1M events/s", "500k predictions/s", "500k outcomes/s",
                        "1M predictions/s", "1M messages/s"},
    "README.md": {"1M events/s"},  # the title of docs/scaling.md in the documentation table
}


@dataclass
class Block:
    """A paragraph, or a table row: the unit a figure and its link to the table share."""

    line: int
    text: str = ""
    hrefs: list[str] = field(default_factory=list)


def blocks(path: Path) -> Iterator[Block]:
    """Paragraphs and table rows of ``path`` (fenced code excluded: commands and sample
    output), with their text and the hrefs of their links."""
    row: Block | None = None
    for tok in tokens(path):
        if tok.type == "tr_open":
            row = Block(tok.map[0] + 1)
        elif tok.type == "tr_close":
            yield row
            row = None
        elif tok.type == "inline":
            block = row if row is not None else Block(tok.map[0] + 1)
            for child in tok.children or []:
                if child.type in ("text", "code_inline"):
                    block.text += child.content
                elif child.type in ("softbreak", "hardbreak"):
                    block.text += " "
                elif child.type == "link_open":
                    block.hrefs.append(str(child.attrs.get("href", "")))
            block.text += " "
            if row is None:
                yield block


def figures(text: str) -> list[tuple[str, str]]:
    """(figure as written, its number normalised) of every benchmark-like figure in ``text``."""
    out, seen = [], set()
    for pattern in FIGURE_PATTERNS:
        for m in pattern.finditer(text):
            number = m.group("n").replace(",", "")
            if m.groupdict().get("k"):
                number += m.group("k")
            if number not in seen:  # one report per number ("0.53x of raw" matches twice)
                seen.add(number)
                out.append((m.group(0).strip(), number))
    return out


@cache
def benchmark_sections(bench: Path = BENCHMARKS) -> dict[str, str]:
    """``bench`` (docs/benchmarks.md) by heading anchor: each heading's text up to the next
    heading of the same or a higher level (so ``#ingest`` holds its subsections); ``""`` is the
    whole file."""
    text = bench.read_text()
    lines = text.splitlines()
    heads = []
    toks = tokens(bench)
    for i, tok in enumerate(toks):
        if tok.type == "heading_open":
            heads.append((tok.map[0], int(tok.tag[1]), github_slug(inline_text(toks[i + 1]))))
    out = {"": text}
    for j, (start, level, slug) in enumerate(heads):
        end = next((s for s, lv, _ in heads[j + 1:] if lv <= level), len(lines))
        out.setdefault(slug, "\n".join(lines[start:end]))
    return out


def numbers_in(text: str) -> set[str]:
    return {n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


def figure_problems(path: Path, rel: str, bench: Path = BENCHMARKS) -> list[str]:
    """Figures of ``path`` that ``bench`` (docs/benchmarks.md) does not back: a paragraph or
    table row quoting a benchmark-like figure must link to ``bench`` (a section or the file),
    and the figure's number must be in the linked section(s)."""
    problems = []
    allowed = ALLOWED_FIGURES.get(rel, set())
    sections = benchmark_sections(bench)
    for block in blocks(path):
        found = [(shown, n) for shown, n in figures(block.text) if shown not in allowed]
        if not found:
            continue
        cited = []
        for href in block.hrefs:
            target, _, anchor = href.partition("#")
            if target and (path.parent / target).resolve() == bench.resolve():
                cited.append(sections.get(anchor, ""))
        where = f"{rel}:{block.line}"
        if not cited:
            problems.append(f"{where}: quotes {[s for s, _ in found]} without a link to the "
                            "docs/benchmarks.md table it comes from")
            continue
        backed = set().union(*(numbers_in(s) for s in cited))
        for shown, n in found:
            if n not in backed:
                problems.append(f"{where}: {shown!r} is not in the docs/benchmarks.md "
                                "section it links to (stale or made up: link, do not copy)")
    return problems


@pytest.mark.parametrize("rel", NARRATIVE)
def test_narrative_docs_quote_no_benchmark_figure_that_benchmarks_md_lacks(rel):
    problems = figure_problems(ROOT / rel, rel)
    assert not problems, "\n".join(problems)


def test_figure_patterns():
    assert [n for _, n in figures("about 0.53x instead of 0.73x of a raw consumer")] == [
        "0.53", "0.73"]
    assert [n for _, n in figures("1.48 µs, 126,000 joined samples/s, 187k msgs/s, "
                                  "1.8 times, a ratio of 0.67; 500 ms, a 5x target, "
                                  "0.45 of raw")] == [
        "1.8", "1.48", "126000", "187k", "0.67", "0.45"]


def test_figure_check_flags_uncited_stale_and_misplaced_figures(tmp_path):
    """The check is live: a figure without a link, a figure the linked section lacks (a stale
    copy), and a figure present elsewhere in benchmarks.md but not in the linked section are
    all found; a cited figure that is in its section passes."""
    bench = tmp_path / "benchmarks.md"
    bench.write_text("# Benchmarks\n\n## ingest\n\n| path | ratio to raw |\n|---|---|\n"
                     "| daemon | **0.67** |\n\n## apply\n\n| apply / TS |\n|---|\n"
                     "| 0.53x |\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "An uncited ratio of 0.67.\n\n"
        "A ratio of 0.67 per [the table](benchmarks.md#ingest).\n\n"
        "A ratio of 0.72 per [the table](benchmarks.md#ingest).\n\n"
        "| variable | meaning |\n|---|---|\n"
        "| `LPCAL_NATIVE` | about 0.53x of a raw consumer ([ingest](benchmarks.md#ingest)) |\n\n"
        "1.99 times faster, per [the benchmarks](benchmarks.md).\n")
    problems = figure_problems(doc, "doc.md", bench)
    assert len(problems) == 4, problems
    assert problems[0].startswith("doc.md:1:") and "without a link" in problems[0]
    assert problems[1].startswith("doc.md:5:") and "0.72" in problems[1]
    assert problems[2].startswith("doc.md:9:") and "0.53x" in problems[2]
    assert problems[3].startswith("doc.md:11:") and "1.99 times" in problems[3]


# --------------------------------------------------------------------------- metrics reference


def test_metrics_reference_in_docs_daemon_md_is_generated_from_the_spec():
    from daemon.metrics import METRIC_NAMES
    from daemon.tools import metrics_doc

    text = metrics_doc.DOC.read_text()
    assert text == metrics_doc.render(text), (
        "the metrics table in docs/daemon.md differs from daemon/metrics.py _SPEC; "
        "regenerate it with: python -m daemon.tools.metrics_doc")
    table = text.split(metrics_doc.BEGIN, 1)[1].split(metrics_doc.END, 1)[0]
    documented = set(re.findall(r"^\| `(lpcal_[a-z_]+)` \|", table, re.MULTILINE))
    assert documented == METRIC_NAMES


def test_metrics_doc_generator_replaces_only_its_block_and_detects_drift(tmp_path):
    from daemon.tools import metrics_doc

    spec = {"lpcal_a_total": ("counter", ("model",), "A | b."), "lpcal_b": ("gauge", (), "B.")}
    table = metrics_doc.metrics_table(spec)
    assert "| `lpcal_a_total` | counter | `model` | A \\| b. |" in table
    assert "| `lpcal_b` | gauge | none | B. |" in table
    doc = tmp_path / "d.md"
    doc.write_text(f"before\n{metrics_doc.BEGIN}\nSTALE TABLE\n{metrics_doc.END}\nafter\n")
    assert metrics_doc.main(["--doc", str(doc), "--check"]) == 1
    assert metrics_doc.main(["--doc", str(doc)]) == 0
    new = doc.read_text()
    assert new.startswith("before\n") and new.endswith("after\n") and "STALE" not in new
    assert metrics_doc.main(["--doc", str(doc), "--check"]) == 0
    doc.write_text("no markers\n")
    assert metrics_doc.main(["--doc", str(doc)]) == 2


# --------------------------------------------------------------------------- the newcomer's CLI


def quickstart() -> tuple[list[str], str]:
    """The commands of the README's Quickstart code block and the section's prose."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1)
    commands = [line.split("#", 1)[0].strip() for line in code.splitlines()]
    return [c for c in commands if c], section


def test_quickstart_is_two_commands_and_says_how_to_reach_the_cli():
    commands, section = quickstart()
    assert commands == ["make demo", "make test"]
    assert "`. .venv/bin/activate`" in section and "`.venv/bin/lpcal`" in section


def test_the_hinted_cli_exists_in_the_venv_the_makefile_builds():
    """The hint names the console script where `make venv` puts it (this run's venv)."""
    import shutil
    import sys

    venv_bin = Path(sys.executable).parent
    if (venv_bin.parent / "pyvenv.cfg").is_file() and venv_bin.parent.name == ".venv":
        assert (venv_bin / "lpcal").is_file(), "the venv has no lpcal console script"
    else:
        pytest.skip("not running from the project's .venv")
    assert shutil.which("make")


@pytest.mark.parametrize("target", ["demo", "test"])
def test_make_demo_and_test_end_with_the_cli_hint(target):
    """`make -n TARGET` (commands printed, not run): the last command prints the hint, after
    the demo / both test runs, and `make test` still exits with the tests' status."""
    import shutil
    import subprocess

    if not shutil.which("make"):
        pytest.skip("no make")
    import os

    # run as a fresh make: under `make test` the parent's MAKEFLAGS and MAKELEVEL would add
    # flags and "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1]
    assert ". .venv/bin/activate" in last and ".venv/bin/lpcal" in last, proc.stdout
    if target == "demo":
        assert "daemon.tools.demo" in lines[-2]
    else:
        assert "-m serial" in lines[-2] and last.rstrip().endswith("exit $status")
        hint = last.rsplit(";", 1)[0]
        out = subprocess.run(["sh", "-c", hint], capture_output=True, text=True, check=True)
        assert out.stdout.strip().splitlines()[0].startswith("The lpcal command is in .venv")


# --------------------------------------------------------------------------- changelog, versions

TRACKER = re.compile(r"\b(?:issues?|findings?|items?|parts?)\s+\d+", re.IGNORECASE)
#: Text files whose words name what the code does, never a tracker's issue or finding number:
#: every doc, comment and docstring of the repository.
TRACKED_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".c", ".h", ".sh"}
NO_TRACKER_NUMBERS = [
    str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*"))
    if (p.suffix in TRACKED_SUFFIXES or p.name == "Makefile") and p.is_file()
    and not any(part in SKIP_DIRS or part.endswith(".egg-info")
                for part in p.relative_to(ROOT).parts)]


def releases() -> list[tuple[str, str]]:
    """(version, date) of each released version in CHANGELOG.md, newest first."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return re.findall(r"^## (\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)$", text, re.MULTILINE)


def test_changelog_is_a_users_changelog_of_released_versions():
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert headings[0] == "Unreleased", "the lead's Unreleased section comes first"
    found = releases()
    assert len(headings) == 1 + len(found), f"a release heading without a date: {headings}"
    versions = [tuple(int(x) for x in v.split(".")) for v, _ in found]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    dates = [d for _, d in found]
    assert dates == sorted(dates, reverse=True)
    assert (0, 3, 0) in versions
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    for section in sections[1:-1]:  # every release but the first says how to upgrade
        assert "### Upgrade notes" in section, section.splitlines()[0]


@pytest.mark.parametrize("rel", NO_TRACKER_NUMBERS)
def test_no_tracker_numbers(rel):
    hits = [m.group(0) for m in TRACKER.finditer((ROOT / rel).read_text())]
    assert not hits, f"{rel} cites tracker numbers {hits}: name what the code does instead"


def test_package_version_is_the_latest_release_and_the_image_tag():
    import tomllib

    import lpcal

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert releases()[0][0] == version, "pyproject.toml's version is not the latest release"
    assert lpcal.__version__ == version, "the installed package is not this tree's version"
    deployment = (ROOT / "deploy" / "k8s" / "base" / "deployment.yaml").read_text()
    overlay = (ROOT / "deploy" / "k8s" / "overlays" / "example" / "kustomization.yaml")
    assert f"image: lpcal:{version}" in deployment
    assert f"newTag: {version}" in overlay.read_text()
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert set(re.findall(r"lpcal:(\d+\.\d+\.\d+)", readme)) == {version}


# --------------------------------------------------------------------------- claims checked against the code


def test_docs_name_the_dead_letter_header_the_daemon_writes():
    from daemon.kafka.deadletter import DLQ_REASON

    for rel in ("config/README.md", "config/lpcal.toml", "deploy/README.md"):
        text = (ROOT / rel).read_text()
        assert DLQ_REASON in text, f"{rel} does not name the dead-letter header {DLQ_REASON}"
        wrong = re.findall(r"[`\"]reason[`\"] header|header [`\"]reason[`\"]", text)
        assert not wrong, f"{rel} calls the dead-letter header {wrong}"


def test_operations_sizes_an_epoch_with_the_real_defaults():
    """docs/operations.md's default eps and epoch size are the daemon's."""
    from daemon.settings import ModelSettings

    text = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    m = re.search(r"With the defaults \(eps = ([\d.]+), p = inf.*?that is ([\d,]+) joined samples",
                  text)
    assert m, "docs/operations.md no longer sizes the default epoch"
    defaults = ModelSettings()
    assert float(m.group(1)) == defaults.eps and defaults.p == float("inf")
    layout = defaults.epoch_spec().layout(3)
    need = layout.warmup + layout.holdout + sum(layout.targets.values())
    assert int(m.group(2).replace(",", "")) == need
