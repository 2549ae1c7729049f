"""Publish benchmarks/RESULTS.md and benchmarks/history/*.md in the site (mkdocs hook, see mkdocs.yml).

They stay beside the benchmark scripts. Each is added under the path a page in docs/ uses to reach it on
GitHub (``../benchmarks/RESULTS.md``), so one relative link works in both places and a strict build checks
it, anchors included.
"""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

# (pattern, in the nav?): the history's files are reached from its README, which the nav lists.
PUBLISHED = [("benchmarks/RESULTS.md", True), ("benchmarks/history/README.md", True),
             ("benchmarks/history/*.md", False)]


def on_files(files: Files, config) -> Files:
    root = Path(config["config_file_path"]).parent
    for pattern, in_nav in PUBLISHED:
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            if files.get_file_from_path("../" + rel) is not None:
                continue
            inclusion = InclusionLevel.INCLUDED if in_nav else InclusionLevel.NOT_IN_NAV
            page = File.generated(config, "../" + rel, abs_src_path=str(path), inclusion=inclusion)
            stem = rel[: -len("/README.md")] if path.name == "README.md" else rel[: -len(".md")]
            if config["use_directory_urls"]:
                page.dest_uri, page.url = f"{stem}/index.html", f"{stem}/"
            else:
                page.dest_uri = page.url = f"{stem}.html"
            files.append(page)
    return files
