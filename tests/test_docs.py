"""The docs: the site builds with ``mkdocs build --strict`` (a broken link, anchor or reference fails it), the
API page lists every public name where it lives, and the README stays a short front page whose links resolve
and whose table gives the figures of the RESULTS rows it cites."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastdata

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:x(?![\d])|%)")  # 1.19x, 0.8%; not the 224x of 224x224
ROW = re.compile(r'<a id="([^"]+)"></a>')


def needs_mkdocs() -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent of a dotted name is missing
            found = False
        if not found:
            pytest.skip(f"needs the docs extra (pip install -e '.[docs]'): {module} is not importable")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner: not a build warning
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strict_and_renders_the_api(tmp_path):
    needs_mkdocs()
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in fastdata.__all__:
        assert f'id="{fastdata._EXPORTS[name]}.{name}"' in api, f"{name} is not rendered in the API page"
    assert (tmp_path / "site" / "benchmarks" / "RESULTS" / "index.html").is_file()


def copy_of_the_docs(tmp_path: Path) -> Path:
    """What the build reads, in a folder of its own: mkdocs.yml, docs/, the package and the results."""
    root = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc")
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    for folder in ("docs", "fastdata", "benchmarks/history"):
        shutil.copytree(ROOT / folder, root / folder, ignore=ignore)
    shutil.copy(ROOT / "benchmarks" / "RESULTS.md", root / "benchmarks" / "RESULTS.md")
    return root


@pytest.mark.parametrize("planted, named", [
    ("[a page that is not there](no-such-page.md)", "no-such-page.md"),
    ("[a row that is not there](../benchmarks/RESULTS.md#no-such-row)", "no-such-row"),
    ("[a name that is not there][fastdata.loading.loader.NoSuchLoader]", "NoSuchLoader"),
])
def test_a_strict_build_fails_on_a_broken_link_or_reference(tmp_path, planted, named):
    needs_mkdocs()
    root = copy_of_the_docs(tmp_path)
    page = root / "docs" / "loading.md"
    page.write_text(page.read_text() + f"\nSee {planted}.\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0, f"the build passed with {planted!r} planted:\n{done.stdout}{done.stderr}"
    assert named in done.stdout + done.stderr


def test_the_api_page_lists_every_public_name_where_it_lives():
    entries = set(re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE))
    expected = {f"{fastdata._EXPORTS[name]}.{name}" for name in fastdata.__all__} | {"fastdata.gpu.dali.DALILoader"}
    assert entries == expected, f"missing: {sorted(expected - entries)}; not public: {sorted(entries - expected)}"


def anchors(path: Path) -> set[str]:
    """The ids a link may point at in a markdown file: explicit ``id="..."`` and GitHub's heading slugs."""
    text = path.read_text()
    ids = set(re.findall(r'id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        ids.add(slug)
    return ids


def broken_links(readme: Path, root: Path) -> list[str]:
    """Relative links of ``readme`` that lead to no file, or to no heading or id in a markdown file."""
    broken = []
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (root / path) if path else readme
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading or id #{anchor} in {path}")
    return broken


def test_the_readme_is_a_short_front_page_whose_links_resolve():
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/ (at most 200)"
    broken = broken_links(readme, ROOT)
    assert not broken, "README.md links that lead nowhere:\n" + "\n".join(broken)


def figures_not_in_their_rows(readme: Path, results: Path) -> list[str]:
    """Ratios and percentages of ``readme``'s table lines that the RESULTS row the line cites does not give."""
    rows = {m.group(1): line for line in results.read_text().splitlines() if (m := ROW.search(line))}
    stale = []
    for line in readme.read_text().splitlines():
        cited = re.findall(r"RESULTS\.md#([\w-]+)", line)
        if not line.startswith("|") or len(cited) != 1:
            continue
        given = set(FIGURE.findall(rows.get(cited[0], "")))  # (whole figures: 45x is not in 2.45x)
        stale += [f"{figure} ({cited[0]})" for figure in FIGURE.findall(line.rpartition("[")[0]) if figure not in given]
    return stale


def test_the_readme_figures_are_the_figures_of_the_rows_they_cite():
    stale = figures_not_in_their_rows(ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md")
    assert not stale, "README.md figures its RESULTS.md row does not give (copy today's figures):\n" + "\n".join(stale)


def test_the_figure_check_finds_a_figure_its_row_does_not_give(tmp_path):
    (tmp_path / "RESULTS.md").write_text('| <a id="loader"></a>loader | **1.30x** / 1.29x at 224x224, 0.8%, 2.45x |\n')
    readme = tmp_path / "README.md"
    readme.write_text("| loader, 224x224 | 1.29x-1.30x, 0.8% | [loader](RESULTS.md#loader) |\n"
                      "| loader | 1.3x, 0.9%, 45x, 30x | [loader](RESULTS.md#loader) |\n"
                      "| gone | 2.0x | [gone](RESULTS.md#gone) |\n"
                      "prose may round: 1.3x ([loader](RESULTS.md#loader))\n")
    assert figures_not_in_their_rows(readme, tmp_path / "RESULTS.md") == [
        "1.3x (loader)", "0.9% (loader)", "45x (loader)", "30x (loader)", "2.0x (gone)"]


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "RESULTS.md").write_text('## Which path when\n\n| <a id="loader"></a>x |\n')
    readme = tmp_path / "README.md"
    readme.write_text("[a](RESULTS.md#loader) [b](RESULTS.md#which-path-when) [c](https://example.com/x.md)\n"
                      "[d](gone.md) [e](RESULTS.md#no-such-row)\n")
    assert broken_links(readme, tmp_path) == ["gone.md: no file gone.md",
                                              "RESULTS.md#no-such-row: no heading or id #no-such-row in RESULTS.md"]


def test_every_option_says_its_default_in_help():
    """`fastdata train --help` showed no default for --batch-size (set by the CLI, not TrainConfig), --augment,
    --lr, --optimizer or --amp; training.md pointed at TrainConfig for defaults the CLI sets."""
    import argparse

    from fastdata.cli.main import build_parser

    def options(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from options(child, f"{name} {sub}")
            elif action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                yield name, action

    parser = build_parser()
    silent = [f"{name} {a.option_strings[-1]}" for name, a in options(parser, "fastdata")
              if not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) and "default" not in (a.help or "")]
    assert silent == []
    train = parser._subparsers._group_actions[0].choices["train"].format_help()
    assert "per process (default 256)" in " ".join(train.split()) and "default flip" in train
