"""Check the house rules a tool checks well: no import cycle between files (inside one package too, and between the
benchmarks), imports only point down the layers, rooms kept APART never import each other, no private name imported
across modules, and prose (docstrings, comments, docs) that tells no history, names nothing that does not exist and
quotes no measured figure in the package. How large a module or a folder grows is a review question (one job per
module), not a number.

    python tools/check_layout.py          # prints every violation, exits 1 if there is one

Imports are read from the source (ast), at module level and inside functions alike: a cycle hidden in a
function body is still a cycle of the design. Cycles are counted between files, as a reader follows them: a name
imported from a package is an edge to the file its `__init__` re-exports it from, and an import under `if
TYPE_CHECKING:` is an edge too (a type is a dependency of the design, even if it never runs). The layer rules skip
`TYPE_CHECKING` blocks; the APART rule does not (a type of the other end is the other end).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "liger_patch_kd"
BENCHMARKS = "benchmarks"
BENCHMARK_PREFIXES = ("bench_", "probe_", "profile_")  # a runnable benchmark's file name

# Layers, lowest first. A module may import from its own layer's room or any lower one, never a higher one.
# Rooms in one layer may not import each other unless listed together in one entry.
LAYERS: list[tuple[str, ...]] = [
    ("utils", "config", "conventions"),
    ("batch",),  # the batch contract (column and marker names): the store, the forward and the trainer share it
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
    ("cli", "__init__"),
]

# Rooms (dotted paths below the package) that never import each other, in either direction, whatever their layers,
# and the room where what they share lives:
# - a teacher server and its clients meet only in wire/, the formats both speak, so the trainer's side never loads
#   the server application and the server never the client (the trainer, the rollout engine's client, shares the
#   server's layer, which already keeps the two apart);
# - the trainer's rollouts (the completions generated steps train on) and its teachers (the sources of a batch's
#   teacher signal) meet in batch/, the collators and row checks both build batches with.
APART: list[tuple[str, str, str]] = [
    ("teacher.client", "server", "wire/"),
    ("trainer.rollouts", "trainer.teachers", "batch/"),
]


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
    for one, other, meeting in APART:
        for a, b in ((one, other), (other, one)):
            if within(module, a, package) and within(target, b, package):
                return f"imports {target}: {a} and {b} never import each other (they meet in {meeting})"
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


def check(
    root: Path = ROOT, package: str = PACKAGE, benchmarks: str | None = BENCHMARKS, prose: bool = True
) -> list[str]:
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    problems: list[str] = []
    for path in files:
        module = module_name(path, root)
        rel = path.relative_to(root)
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
    bench_modules = {module_name(f, root) for f in bench_files}
    for path in bench_files:  # one benchmark never imports another: what they share is in benchmarks/common
        for line, target, _, _ in imports(path, bench_modules, root, (benchmarks,)):
            if target != module_name(path, root) and target.split(".")[-1].startswith(BENCHMARK_PREFIXES):
                rel = path.relative_to(root)
                share = f"move what they share to {benchmarks}/common"
                problems.append(f"{rel}:{line}: imports the benchmark {target}: {share}")
    for component in find_cycles(file_graph(bench_files, bench_modules, root, (benchmarks,))):
        problems.append("import cycle between benchmarks: " + " -> ".join(component))
    if prose:
        problems += history_problems(root) + stale_name_problems(root, package)
        problems += measured_figure_problems(root, package)
    problems += column_literal_problems(root, package)
    return problems


# ----------------------------------------------------------------------------------------- the batch contract
# A batch's column and marker names are spelled once, in batch/columns.py (CONTRACT_NAMES); anywhere else in the
# package a string literal equal to one of them is a second spelling, which a rename would miss. Docstrings and the
# text of f-strings are prose, not spellings. Not checked: the loss functions (losses/, reference/), whose parameters
# are named after the columns they take but are an API of their own (a column renamed keeps its parameter).
CONTRACT_MODULE = ("batch", "columns.py")
PARAMETER_ROOMS = ("losses", "reference")


def contract_names(root: Path, package: str = PACKAGE) -> frozenset[str]:
    path = root / package / Path(*CONTRACT_MODULE)
    if not path.exists():
        return frozenset()
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # constants only: the contract imports nothing
    return frozenset(namespace.get("CONTRACT_NAMES", ()))


def column_literal_problems(root: Path, package: str = PACKAGE) -> list[str]:
    names = contract_names(root, package)
    contract = root / package / Path(*CONTRACT_MODULE)
    skipped = tuple(root / package / folder for folder in PARAMETER_ROOMS)
    problems = []
    for path in sorted((root / package).rglob("*.py")) if names else ():
        if path == contract or any(path.is_relative_to(folder) for folder in skipped):
            continue
        tree = ast.parse(path.read_text(), str(path))
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        prose |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in prose:
                problems.append(f"{path.relative_to(root)}:{node.lineno}: spells the column {node.value!r}: import its "
                                f"name from {package}.batch.columns")  # fmt: skip
    return problems


# ------------------------------------------------------------------------------------------- prose rules
# Prose (docstrings, comments, docs) is read by people who never saw the project's tracker or its history, and it
# must name only what exists. Three rules a tool checks well:
# - history: no tracker number ("issue <n>", "issue<n>-loss"), no "wave <n>" or "round <n>", no "session" as a unit
#   of work (the last one, "session <n>"). A decode session (the engine's cache and graph) is a thing, not
#   history, and is allowed; so is another project's tracker: "TRL #3055" (no "issue" word), or "issue <n>" on a
#   line that links to that number's page (github.com/<owner>/<repo>/issues/<n>).
# - stale names: a `*.py` / `*.md` / `*.sh` file, a dotted `liger_patch_kd.<module>.<name>` (or one that starts at
#   a subpackage: `teacher.store.verify_store`), a repository path (tests/..., benchmarks/..., docs/..., tools/...,
#   liger_patch_kd/...) or a path inside the package (teacher/store/, models/patch.py) named in prose must exist.
#   A file name resolves against the file's own folder and every file of the repository (its whole path or any
#   tail of it: "store/reader.py", "reader.py"); a dotted name against the modules and the names they bind, from
#   the package or from any package above the file. `trainer.<x>` and `teacher.<x>` are checked only where <x> is
#   a module: in prose they are mostly a Trainer's or a teacher model's attributes (`trainer.train()`).
# - measured figures: no hardware timing or throughput (ms, us, TB/s, TFLOP/s, tokens/s, "<n>x faster") and no
#   GPU model beside a number in the package's docstrings and comments: such figures rot as the code and the
#   drivers change; they live in benchmarks/results and docs/benchmarks.md, with the command that made them.
PROSE_TREES = ("liger_patch_kd", "tests", "benchmarks", "docs", "tools", "examples", "README.md")
PROSE_SUFFIXES = (".py", ".md", ".sh")
RECORDED = ("benchmarks/results", "docs/reference")  # recorded logs and generated pages: their sources are checked
HISTORY = re.compile(
    r"\bissues?[\s_-]*#?\d+"
    r"|\bwaves?[\s_-]*\d+"
    r"|\brounds?[\s_-]*\d+(?![\d.]*\s*(?:decimal|digit|place|bit|significant))"
    r"|\b(?:this|last|previous|earlier|later|first|second|third|fourth|fifth|a\s+later|an\s+earlier)\s+"
    r"(?:work\s+)?sessions?\b(?!['’]s\s+(?:cache|graph|key|buffers))"
    r"|\bsessions?\s+\d+",
    re.IGNORECASE,
)
OTHER_TRACKER = re.compile(r"github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/(\d+)")
MEASURED = re.compile(
    r"\d[\d.,]*\s*(?:ms|us|µs|ns|[KMGT]B/s|[KMGT]iB/s|TFLOP/s|TFLOPS|tokens/s|tok/s)(?![\w/])"
    r"|\d[\d.,]*\s*(?:x|×|times)\s+(?:faster|slower|quicker)"
    r"|\b[HAB]\d00\b.*\d|\d.*\b[HAB]\d00\b",
)
FILE = re.compile(r"(?<![\w/.*-])[\w./*-]*[\w*]\.(?:py|md|sh)\b")
URL = re.compile(r"\b(?:https?|file)://\S+")
FILE_SUFFIXES = ("py", "md", "sh", "json", "jsonl", "parquet", "txt", "log", "yaml", "yml", "cfg", "toml", "pt")
INSTANCE_LIKE = ("trainer", "teacher")  # rooms named like the objects prose talks about: trainer.train()


def prose_files(root: Path, trees: tuple[str, ...] = PROSE_TREES) -> list[Path]:
    found = []
    for tree in trees:
        base = root / tree
        paths = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        found += [p for p in paths if p.is_file() and p.suffix in PROSE_SUFFIXES
                  and not p.relative_to(root).as_posix().startswith(tuple(f"{r}/" for r in RECORDED))]  # fmt: skip
    return found


@functools.lru_cache(maxsize=None)
def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a reader reads as prose: a Python file's docstrings and comments, a shell script's
    comments, every line of a Markdown page."""
    text = path.read_text()
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    if path.suffix == ".sh":
        return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith("#")]
    found = []
    statements: list[ast.AST] = [ast.parse(text, str(path))]
    while statements:  # statements only (a docstring is one), not every expression node: this runs on every file
        node = statements.pop()
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            doc = first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            if isinstance(doc, str):
                found += [(first.lineno + i, line) for i, line in enumerate(doc.splitlines())]
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            statements += [child for child in getattr(node, field, None) or () if isinstance(child, ast.AST)]
    found += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(text).readline)
              if token.type == tokenize.COMMENT]  # fmt: skip
    return found


def history_problems(root: Path) -> list[str]:
    """Every line of code, tests, benchmarks and docs (strings and names too: a mode named after a tracker number
    is history as much as a comment is)."""
    problems = []
    for path in prose_files(root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            linked = set(OTHER_TRACKER.findall(line))
            for match in HISTORY.finditer(line):
                if match.group().lower().startswith("issue") and re.sub(r"\D", "", match.group()) in linked:
                    continue
                problems.append(f"{path.relative_to(root)}:{number}: {match.group()!r} is history: say what the "
                                f"thing is or does")  # fmt: skip
    return problems


class Names:
    """What prose may name: the repository's files and folders (and every tail of their paths), the package's
    modules and the names each binds."""

    def __init__(self, root: Path, package: str = PACKAGE):
        self.root, self.package = root, package
        self.tails: set[str] = set()
        for path in root.rglob("*"):
            parts = path.relative_to(root).parts
            if any(part.startswith(".") or part == "__pycache__" for part in parts):
                continue
            for i in range(len(parts)):
                self.tails.add("/".join(parts[i:]))
                if path.suffix == ".py":
                    self.tails.add("/".join(parts[i:])[:-3])  # models/patch names models/patch.py
        base = root / package
        self.modules = {module_name(p, root): p for p in base.rglob("*.py")} if base.is_dir() else {}
        self.folders = {p.name for p in base.rglob("*") if p.is_dir() and p.name != "__pycache__"}
        self.subpackages = {m.split(".")[1] for m, p in self.modules.items()
                            if p.name == "__init__.py" and m.count(".") == 1}  # fmt: skip
        self._bound: dict[str, set[str]] = {}

    def bound(self, module: str) -> set[str]:
        """The names `module` defines, assigns or imports (`*` imports followed) and, for the package root, the
        names its __getattr__ serves from the subpackages."""
        if module not in self._bound:
            self._bound[module] = names = set()
            path = self.modules[module]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*":
                    target = resolve(module, path.name == "__init__.py", node)
                    names |= self.bound(target) if target in self.modules else set()
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in node.names)
            if module == self.package:
                for sub in self.subpackages:
                    names |= self.bound(f"{module}.{sub}")
        return self._bound[module]

    def dotted_exists(self, dotted: str) -> bool:
        """`liger_patch_kd.teacher.store.verify_store`: modules down as far as they go, then one name the last
        module binds (an attribute of that, `KDTrainer.compute_loss`, is not followed)."""
        parts = dotted.split(".")
        module = parts[0]
        for part in parts[1:]:
            if f"{module}.{part}" in self.modules:
                module = f"{module}.{part}"
                continue
            return part in self.bound(module)
        return True

    def relative_exists(self, dotted: str, inside: str) -> bool:
        """A dotted name that starts below the package (`teacher.store.verify_store`), from the package or from
        any package above the module `inside` (`store.reader` inside liger_patch_kd.teacher)."""
        parts = dotted.split(".")
        if parts[-1] in FILE_SUFFIXES:  # trainer.py, teacher.parquet: a file's name, checked as one
            return True
        if parts[0] in INSTANCE_LIKE and f"{self.package}.{parts[0]}.{parts[1]}" not in self.modules:
            return True
        bases = [self.package, *(b for b in parents(inside) + [inside] if b.startswith(self.package + "."))]
        return any(f"{b}.{parts[0]}" in self.modules and self.dotted_exists(f"{b}.{dotted}") for b in bases)

    def path_exists(self, name: str, folder: Path) -> bool:
        """A file or folder named relative to `folder`, or a tail of a repository path ('*' matches as a glob)."""
        name = name.rstrip("/.")
        if "*" in name:
            return any(folder.glob(name)) or any(self.root.glob(name)) or any(self.root.glob("**/" + name))
        if (folder / name).exists():
            return True
        return re.sub(r"^(?:\.\.?/)+", "", name) in self.tails


def stale_name_problems(root: Path, package: str = PACKAGE) -> list[str]:
    names = Names(root, package)
    rooms = "|".join(sorted(names.folders)) or "(?!)"
    repo_path = re.compile(rf"(?<![\w/.-])(?:{package}|tests|benchmarks|docs|tools|examples)/[\w./*-]*[\w/*]")
    package_path = re.compile(rf"(?<![\w/.-])(?:{rooms})/(?:[\w-]+/)*[\w-]+(?:\.py)?/?(?![\w.-])")
    dotted = re.compile(rf"(?<![\w.]){package}(?:\.\w+)+")
    subpackages = "|".join(sorted(names.subpackages)) or "(?!)"
    relative = re.compile(rf"(?<![\w./])(?:{subpackages})(?:\.[a-z_]\w*)+")
    problems = []
    for path in prose_files(root):
        rel = path.relative_to(root)
        inside = module_name(path, root) if rel.parts[0] == package else ""
        for number, line in prose_lines(path):
            line = URL.sub(" ", line)
            stale = [m.group() for m in FILE.finditer(line) if not names.path_exists(m.group(), path.parent)]
            stale += [m.group() for m in repo_path.finditer(line) if not names.path_exists(m.group(), root)]
            stale += [m.group() for m in package_path.finditer(line) if not names.path_exists(m.group(), path.parent)]
            stale += [m.group() for m in dotted.finditer(line) if not names.dotted_exists(m.group())]
            stale += [m.group() for m in relative.finditer(line) if not names.relative_exists(m.group(), inside)]
            problems += [f"{rel}:{number}: names {name}, which does not exist" for name in dict.fromkeys(stale)]
    return problems


def measured_figure_problems(root: Path, package: str = PACKAGE) -> list[str]:
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        for number, line in prose_lines(path):
            problems += [f"{path.relative_to(root)}:{number}: {m.group()!r} is a measured figure: keep the reason, "
                         f"leave the figure to benchmarks/results and docs/benchmarks.md"
                         for m in MEASURED.finditer(line)]  # fmt: skip
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    ok = "layout ok: no cycle between files, layers respected, no private import, prose names what exists"
    print(f"{len(problems)} problem(s)" if problems else ok)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
