"""The import graph of oelm_core, read from its source (no module is imported): every import
statement at any depth (those inside functions run when called), relative ones, and
importlib/__import__ calls with a constant name. tests/test_imports.py and tests/test_fast.py
check rules on it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oelm_core"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, name: str = "") -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` (the module ``name``, by default the one the
    path is), at any depth, absolute: ``from a import b`` names ``a.b`` where that is a module,
    else ``a``; ``importlib.import_module("x")`` and ``__import__("x")`` with a constant name
    count too."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports ("oelm_core.runner.plan", ...)."""
    return {m: {i for _, i in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, each listed once from its smallest module name."""
    found = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.append(list(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found
