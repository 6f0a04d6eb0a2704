"""The layers of the package: the core under everything, heads on it, the stages side by side on both.

specheads' core (`specheads/`, its decoding package included: models and their placement, prompts, the labelled
dataset's format, checkpoints and reports, the sampling transform, signals, decoding) and the heads (the product's
model code, which the core reads checkpoints into and decodes with) import no stage; each stage (data_gen, train,
eval, export) imports the core, heads and its own modules, never another stage's; demo runs the stages and may
import them all. The entry point (specheads.cli) dispatches to every stage by name and is not a layer.
docs/packages.md draws the same map.

No module of the package imports itself back through others (`test_no_module_imports_itself_back_through_others`):
every import counts, at the top of a module, inside a function (a lazy import is still a dependency, only deferred)
and under `TYPE_CHECKING`. The last are counted too, though they never run: a type named in a module's signatures is
part of what the module says, so a module that annotates with a type from a module above it cannot be read, moved or
tested without that module (two of the four circles issue 52 named, models ↔ placement and gen's config ↔
placement, ran through TYPE_CHECKING imports only); the fix is to move the shared type down, not to hide the import.
"""

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).parents[1]
STAGES = ("data_gen", "train", "eval", "export")
STAGE_FOLDERS = ("data_gen", "heads", "train", "eval", "export", "demo")


def floor_of_module(name: str) -> str | None:
    """The floor of a `specheads...` module name; None for other packages."""
    parts = name.split(".")
    if parts[0] != "specheads":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in STAGE_FOLDERS else "core"


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def allowed(importer: str, imported: str) -> bool:
    """May a module of layer `importer` import one of layer `imported`?"""
    if importer == imported or importer == "demo":
        return True
    return imported in ("core", "heads")  # core and heads among themselves; a stage on both


def core_sources() -> list[Path]:
    return [p for p in sorted((ROOT / "specheads").rglob("*.py")) if p.relative_to(ROOT / "specheads").as_posix()
            not in ("cli.py", "__main__.py")]


def test_no_stage_imports_another_and_the_core_and_heads_import_no_stage():
    sources = {folder: sorted((ROOT / folder).rglob("*.py")) for folder in STAGE_FOLDERS}
    sources["core"] = core_sources()
    crossing = []
    for layer, files in sources.items():
        for path in files:
            for name in imports_of(path):
                target = floor_of_module(name)
                if target is not None and not allowed(layer, target):
                    crossing.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not crossing, "\n".join(crossing)
    assert sum(len(files) for files in sources.values()) > 50  # the walk saw the whole package
    assert any(path.parent.name == "decoding" for path in sources["core"])  # and the core's subpackages


def test_no_stage_is_imported_by_its_top_level_name():
    bare = [f"{path.relative_to(ROOT)} imports {name}"
            for folder in (*STAGE_FOLDERS, "specheads", "tests", "benchmarks")
            for path in sorted((ROOT / folder).rglob("*.py"))
            for name in imports_of(path) if name.split(".")[0] in STAGE_FOLDERS]
    assert not bare, "\n".join(bare)


def test_metrics_json_is_written_and_read_in_one_module():
    """Every consumer of a report (tuning, export, the card, the demo) goes through specheads/artifacts/report_file.py."""
    holders = []
    for folder in (*STAGE_FOLDERS, "specheads"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            constants = [node.value for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)]
            if "metrics.json" in constants:
                holders.append(str(path.relative_to(ROOT)))
    assert holders == ["specheads/artifacts/report_file.py"]


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name; a stage's folder installs as `specheads.<stage>`."""
    found = {}
    for base, folder in (((), ROOT / "specheads"), *((("specheads",), ROOT / f) for f in STAGE_FOLDERS)):
        for path in sorted(folder.rglob("*.py")):
            parts = [*base, *path.relative_to(ROOT).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules among `modules` that module `name` imports, each with the line of its import: every import
    statement counts, at the top, inside a function or under TYPE_CHECKING. `from package import name` is an import
    of the submodule where `name` is one, of the package otherwise."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """{importer: {imported: line of the first import}} over `modules`."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imported_modules(name, path, modules):
            edges.setdefault(target, line)
    return graph


def import_knots(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The knots of modules that import each other, directly or through others: the strongly connected components of
    more than one module (Tarjan's algorithm), ordered by their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            knot = {stack.pop()}
            while node not in knot:
                knot.add(stack.pop())
            if len(knot) > 1:
                knots.append(knot)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(knots, key=min)


def shortest_circle(graph: dict[str, dict[str, int]], knot: set[str]) -> list[str]:
    """The shortest circle from the knot's first module back to it, as [a, b, ..., a]: breadth first inside the
    knot, the first module reached that imports the start closes it."""
    start = min(knot)
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if start in graph[node]:
            circle = [node]
            while (before := parent[circle[0]]) is not None:
                circle.insert(0, before)
            return [*circle, start]
        for target in sorted(graph[node]):
            if target in knot and target not in parent:
                parent[target] = node
                queue.append(target)
    raise AssertionError(f"{sorted(knot)} is no knot")


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per knot (`shortest_circle`)."""
    return [shortest_circle(graph, knot) for knot in import_knots(graph)]


def describe_circle(circle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path],
                    root: Path | None = None) -> str:
    """`a → b → a (a.py:3 imports b, b.py:7 imports a)`, the files relative to `root` (the repository's by default)."""
    where = ", ".join(f"{modules[a].relative_to(root or ROOT)}:{graph[a][b]} imports {b}" for a, b in zip(circle, circle[1:]))
    return f"{' → '.join(circle)} ({where})"


def test_no_module_imports_itself_back_through_others():
    modules = package_modules()
    graph = import_graph(modules)
    circles = []
    for knot in import_knots(graph):
        circle = shortest_circle(graph, knot)
        others = sorted(knot - set(circle))
        circles.append(describe_circle(circle, graph, modules) + (f"; the same knot also holds {', '.join(others)}"
                                                                  if others else ""))
    assert not circles, ("import circles; break each by moving what the modules share into the lower one, or by "
                         "having the higher one register itself:\n" + "\n".join(circles))
    assert len(modules) > 50 and {"specheads.eval.run", "specheads.decoding.rules"} <= set(graph)  # the whole package


def test_the_circle_finder_counts_lazy_and_type_checking_imports_and_names_the_circle(tmp_path):
    """On a package made for it: an import inside a function closes one circle, one under TYPE_CHECKING another, each
    named with its files and lines; a module that only imports into a circle is not part of it."""
    sources = {"a": "from pkg import b\n", "b": "def f():\n    from pkg.a import x\n", "c": "from pkg.d import y\n",
               "d": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.c import Z\n",
               "e": "import os\nimport pkg.a\n", "__init__": ""}
    (tmp_path / "pkg").mkdir()
    modules = {}
    for name, text in sources.items():
        (tmp_path / "pkg" / f"{name}.py").write_text(text)
        modules["pkg" if name == "__init__" else f"pkg.{name}"] = tmp_path / "pkg" / f"{name}.py"
    graph = import_graph(modules)
    assert (graph["pkg.a"], graph["pkg.b"], graph["pkg.d"], graph["pkg.e"]) == \
        ({"pkg.b": 1}, {"pkg.a": 2}, {"pkg.c": 4}, {"pkg.a": 2})
    circles = import_circles(graph)
    assert circles == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]
    assert describe_circle(circles[1], graph, modules, tmp_path) == \
        "pkg.c → pkg.d → pkg.c (pkg/c.py:1 imports pkg.d, pkg/d.py:4 imports pkg.c)"
    (tmp_path / "pkg" / "b.py").write_text("import os\n")
    assert import_circles(import_graph(modules)) == [["pkg.c", "pkg.d", "pkg.c"]]
