"""Check the package's house rules: no import cycle between files (inside one package too, and between the
benchmarks), imports only point down the layers, rooms kept APART never import each other, no private name imported
across modules, no file over the size limit, no folder of more than MAX_MODULES modules.

    python tools/check_layout.py          # prints every violation, exits 1 if there is one

Imports are read from the source (ast), at module level and inside functions alike: a cycle hidden in a
function body is still a cycle of the design. Cycles are counted between files, as a reader follows them: a name
imported from a package is an edge to the file its `__init__` re-exports it from, and an import under `if
TYPE_CHECKING:` is an edge too (a type is a dependency of the design, even if it never runs). The layer rules skip
`TYPE_CHECKING` blocks; the APART rule does not (a type of the other end is the other end).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "liger_patch_kd"
BENCHMARKS = "benchmarks"
MAX_LINES = 400
BENCHMARK_PREFIXES = ("bench_", "probe_", "profile_")  # a runnable benchmark's file name
MAX_MODULES = 16  # modules of one folder, its __init__ aside: beyond that a reader needs rooms

# Layers, lowest first. A module may import from its own layer's room or any lower one, never a higher one.
# Rooms in one layer may not import each other unless listed together in one entry.
LAYERS: list[tuple[str, ...]] = [
    ("utils", "config", "conventions"),
    ("reference", "ops"),
    ("wire",),  # the formats a teacher server and its clients speak: pure, so both ends import them
    ("losses",),
    ("align",),
    ("distributed",),  # imports nothing above torch; models and the trainer read lm_head weights through it
    ("models",),
    ("generation",),  # in-process decoding (the KV cache, the captured step): knows models, not the Trainer
    ("teacher",),
    ("trainer", "server"),  # the server application (`liger-kd serve`: teachers, rollouts) and the trainer, its client
    ("demo",),
    ("cli_checks",),
    ("train_cli",),  # `liger-kd train`: the Trainer from a command line
    ("cli", "__init__", "teacher_data"),
]

# Rooms (dotted paths below the package) that never import each other, in either direction, whatever their layers:
# a teacher server and its clients meet only in wire/, the formats both speak, so the trainer's side never loads the
# server application and the server never the client (the trainer, the rollout engine's client, shares the
# server's layer, which already keeps the two apart).
APART: list[tuple[str, str]] = [("teacher.client", "server")]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def within(module: str, room_path: str, package: str = PACKAGE) -> bool:
    """Whether `module` is the room `room_path` ("teacher.client") of `package` or inside it."""
    prefix = f"{package}.{room_path}"
    return module == prefix or module.startswith(prefix + ".")


def apart_problem(module: str, target: str, package: str = PACKAGE) -> str | None:
    for one, other in APART:
        for a, b in ((one, other), (other, one)):
            if within(module, a, package) and within(target, b, package):
                return f"imports {target}: {a} and {b} never import each other (they meet in wire/)"
    return None


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


def imports(
    path: Path, modules: set[str], root: Path = ROOT, prefixes: tuple[str, ...] = (PACKAGE,)
) -> list[tuple[int, str, list[str], bool]]:
    """(line, imported module, names, under TYPE_CHECKING) for every import of `prefixes` inside `path`."""
    module = module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    skipped = type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        typing_only = getattr(node, "lineno", None) in skipped
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, [], typing_only) for alias in node.names
                      if alias.name.split(".")[0] in prefixes]  # fmt: skip
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, path.name == "__init__.py", node)
            if target.split(".")[0] not in prefixes:
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in modules]
            if submodules:  # `from . import store` imports the module store
                found += [(node.lineno, sub, [], typing_only) for sub in submodules]
                names = [n for n in names if f"{target}.{n}" not in modules]
            if names or not submodules:
                found.append((node.lineno, target, names, typing_only))
    return found


def reexports(files: list[Path], modules: set[str], root: Path) -> dict[str, dict[str, str]]:
    """package -> {name: the module its __init__ imports the name from}."""
    table: dict[str, dict[str, str]] = {}
    for path in files:
        if path.name != "__init__.py":
            continue
        package = module_name(path, root)
        for _, target, names, _ in imports(path, modules, root, (root_of(package),)):
            if target.startswith(package + ".") and target in modules:
                table.setdefault(package, {}).update(dict.fromkeys(names, target))
    return table


def defining_module(target: str, name: str, table: dict[str, dict[str, str]]) -> str:
    """The file a name imported from `target` comes from, following packages' re-exports down."""
    for _ in range(16):
        source = table.get(target, {}).get(name)
        if source is None:
            return target
        target = source
    return target


def root_of(module: str) -> str:
    return module.split(".")[0]


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


def file_graph(files: list[Path], modules: set[str], root: Path, prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules (files) it imports, re-exports followed to their file, TYPE_CHECKING imports kept."""
    table = reexports(files, modules, root)
    graph: dict[str, set[str]] = {}
    for path in files:
        module = module_name(path, root)
        for _, target, names, _ in imports(path, modules, root, prefixes):
            if target not in modules:
                continue
            # a package's own __init__ re-exporting its children is not an edge of the design
            if path.name == "__init__.py" and target.startswith(module + "."):
                continue
            targets = {defining_module(target, name, table) for name in names} if names else {target}
            graph.setdefault(module, set()).update(t for t in targets if t != module and module not in parents(t))
    return graph


def folder_sizes(files: list[Path], root: Path) -> list[str]:
    counts: dict[Path, int] = {}
    for path in files:
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    return [f"{folder.relative_to(root)}/: {n} modules (limit {MAX_MODULES}): give its jobs rooms"
            for folder, n in sorted(counts.items()) if n > MAX_MODULES]  # fmt: skip


def check(root: Path = ROOT, package: str = PACKAGE, benchmarks: str | None = BENCHMARKS) -> list[str]:
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    problems: list[str] = folder_sizes(files, root)
    for path in files:
        module = module_name(path, root)
        rel = path.relative_to(root)
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{rel}: {lines} lines (limit {MAX_LINES}): split it by job")
        for line, target, names, typing_only in imports(path, modules, root, (package,)):
            if target in modules and (problem := apart_problem(module, target, package)):
                problems.append(f"{rel}:{line}: {problem}")
            if target not in modules or typing_only:
                continue
            if target.startswith(module + ".") and path.name == "__init__.py":
                continue
            if layer_of(target) > layer_of(module):
                above = f"{room(target)} above {room(module)}"
                problems.append(f"{rel}:{line}: imports {target} from a higher layer ({above})")
            elif layer_of(target) == layer_of(module) and room(target) != room(module):
                problems.append(f"{rel}:{line}: imports {target} across rooms of one layer")
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != module:
                    problems.append(f"{rel}:{line}: imports the private name {name} from {target}")
    for component in find_cycles(file_graph(files, modules, root, (package,))):
        problems.append("import cycle: " + " -> ".join(component))
    bench_files = sorted((root / benchmarks).rglob("*.py")) if benchmarks and (root / benchmarks).is_dir() else []
    problems += folder_sizes(bench_files, root)  # a benchmark's room (loss, training, ...) holds its kind
    bench_modules = {module_name(f, root) for f in bench_files}
    for path in bench_files:  # one benchmark never imports another: what they share is in benchmarks/common
        for line, target, _, _ in imports(path, bench_modules, root, (benchmarks,)):
            if target != module_name(path, root) and target.split(".")[-1].startswith(BENCHMARK_PREFIXES):
                rel = path.relative_to(root)
                share = f"move what they share to {benchmarks}/common"
                problems.append(f"{rel}:{line}: imports the benchmark {target}: {share}")
    for component in find_cycles(file_graph(bench_files, bench_modules, root, (benchmarks,))):
        problems.append("import cycle between benchmarks: " + " -> ".join(component))
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    ok = "layout ok: no cycle between files, layers respected, no private import, no crowded folder"
    print(f"{len(problems)} problem(s)" if problems else ok)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
