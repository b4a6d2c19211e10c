"""Check the package's house rules: no import cycle, imports only point down the layers, no private name
imported across modules, no file over the size limit.

    python tools/check_layout.py          # prints every violation, exits 1 if there is one

Imports are read from the source (ast), at module level and inside functions alike: a cycle hidden in a
function body is still a cycle of the design. `if TYPE_CHECKING:` blocks are skipped (they never run).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "liger_patch_kd"
MAX_LINES = 400

# Layers, lowest first. A module may import from its own layer's room or any lower one, never a higher one.
# Rooms in one layer may not import each other unless listed together in one entry.
LAYERS: list[tuple[str, ...]] = [
    ("utils", "config", "conventions"),
    ("reference", "ops"),
    ("losses",),
    ("align",),
    ("distributed",),  # imports nothing above torch; models and the trainer read lm_head weights through it
    ("models",),
    ("generation",),  # in-process decoding (the KV cache, the captured step): knows models, not the Trainer
    ("teacher",),
    ("trainer",),
    ("demo",),
    ("cli_checks",),
    ("cli", "__init__", "teacher_data"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    name = room(module)
    for index, rooms in enumerate(LAYERS):
        if name in rooms:
            return index
    raise KeyError(f"{module}: room {name!r} is in no layer of tools/check_layout.py: add it")


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def type_checking_lines(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return skipped


def imports(path: Path, modules: set[str]) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import of the package inside `path`."""
    module = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    skipped = type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if alias.name.startswith(PACKAGE)]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, path.name == "__init__.py", node)
            if not target.startswith(PACKAGE):
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in modules]
            if submodules:  # `from . import store` imports the module store
                found += [(node.lineno, sub, []) for sub in submodules]
                names = [n for n in names if f"{target}.{n}" not in modules]
            if names or not submodules:
                found.append((node.lineno, target, names))
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def check(root: Path = ROOT) -> list[str]:
    files = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(f) for f in files}
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for path in files:
        module = module_name(path)
        rel = path.relative_to(root)
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{rel}: {lines} lines (limit {MAX_LINES}): split it by job")
        for line, target, names in imports(path, modules):
            if target not in modules:
                continue
            # a package's own __init__ re-exporting its children is not an edge of the design
            if target.startswith(module + ".") and path.name == "__init__.py":
                continue
            if target != module and module not in parents(target):
                graph.setdefault(module, set()).add(target)
            if layer_of(target) > layer_of(module):
                above = f"{room(target)} above {room(module)}"
                problems.append(f"{rel}:{line}: imports {target} from a higher layer ({above})")
            elif layer_of(target) == layer_of(module) and room(target) != room(module):
                problems.append(f"{rel}:{line}: imports {target} across rooms of one layer")
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != module:
                    problems.append(f"{rel}:{line}: imports the private name {name} from {target}")
    for component in find_cycles(graph):
        problems.append("import cycle: " + " -> ".join(component))
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)" if problems else "layout ok: no cycle, layers respected, no private import")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
