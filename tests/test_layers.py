"""The package's import graph: each layer imports only downward, and no module imports itself back through
others, counting imports inside functions too (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

import fastdata

ROOT = Path(fastdata.__file__).parent
# One row per package, lowest first: a module may import its own row or any row below it. storage sits
# below preprocess because a source at a URL (tars in a bucket) is read through storage.object_store.
LAYERS = [
    ["fastdata.errors", "fastdata._io", "fastdata._limits", "fastdata._version", "fastdata.distributed",
     "fastdata.progress"],
    ["fastdata.formats"],
    ["fastdata.imaging"],
    ["fastdata.storage"],
    ["fastdata.preprocess"],
    ["fastdata.datasets"],
    ["fastdata.loading"],
    ["fastdata.gpu", "fastdata.dali"],  # fastdata.dali: the door to fastdata.gpu.dali
    ["fastdata.train"],
    ["fastdata.cli", "fastdata.__main__"],
]


def module_name(path: Path) -> str:
    parts = ("fastdata",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every fastdata module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.startswith("fastdata") and t != name}
    return out & known


def layer(name: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(name == n or name.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in {__file__}")


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports(n, p, set(mods)) for n, p in mods.items() if n != "fastdata"}


def test_every_import_points_down_the_layers():
    wrong = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
             for a, deps in graph().items() for b in deps if b != "fastdata" and layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in sorted(g.get(n, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]) if d in stack else f"{n} -> {d}")
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)
    assert not any("fastdata" in deps for deps in g.values()), "a module imports the package __init__"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "loader.py"
    path.write_text("def f():\n    from .bench import load_config\n")
    assert imports("fastdata.loader", path, {"fastdata.bench", "fastdata.loader"}) == {"fastdata.bench"}


def test_a_source_tree_used_without_installing_it_knows_its_version(tmp_path):
    import re
    import shutil
    import subprocess
    import sys

    from fastdata._version import _source_version

    declared = re.search(r'^version = "(.+)"', (ROOT.parent / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert _source_version() == f"{declared}+source"
    shutil.copytree(ROOT, tmp_path / "fastdata")  # a copy with no pyproject.toml beside it, never installed
    code = "import fastdata._version as v; print(v._source_version())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.0.0+unknown"


def test_preprocess_never_imports_torch(tmp_path):
    """`fastdata preprocess` (images and text, with worker processes) runs where torch cannot be imported: a
    `torch` package that raises is first on the path of the command and of every process it starts."""
    import subprocess
    import sys

    from PIL import Image

    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('fastdata preprocess imported torch')\n")
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (20, 16), (i * 40, 90, 7)).save(src / c / f"{i}.jpg")
    (tmp_path / "t.txt").write_text("some text to tokenise, more than a few tokens long. " * 20)
    env = {**__import__("os").environ, "PYTHONPATH": f"{fake.parent}:{ROOT.parent}"}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert "fastdata preprocess imported torch" in probe.stderr  # the trap works
    for fmt in ("npy", "lmdb"):
        r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "images", str(src), str(tmp_path / fmt),
                            "--size", "8", "--format", fmt, "--workers", "2", "--quiet"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "text", str(tmp_path / "t.txt"),
                        str(tmp_path / "tok"), "--tokenizer", "bytes", "--quiet"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
