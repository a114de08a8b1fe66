"""The repository's folders install under one namespace, pdserve.*, so that PyPI's own `kernels` (which
transformers can use) or `bench` installed beside pdserve cannot shadow them, or be shadowed."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "server", "kernels", "bench")


def test_every_package_folder_is_installed_under_pdserve():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"pdserve." + ".".join(init.parent.relative_to(ROOT).parts)
               for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert listed == folders | {"pdserve"}


def test_nothing_imports_the_folders_by_their_bare_names():
    """Every import of the project's code says pdserve.: a bare `kernels` would be PyPI's (or, run from the
    repository root, this folder under a name transformers probes for its own `kernels`)."""
    bare = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.parts[len(ROOT.parts)] not in (*FOLDERS, "tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            bare += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bare, "imports without the pdserve. prefix:\n" + "\n".join(bare)
