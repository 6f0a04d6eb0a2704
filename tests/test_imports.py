"""The floors of the package: a module imports only from its own floor or the floors below it.

specheads' shared core (sampling transform, state reading, atomic writes, shared metrics, errors) is the
ground floor; above it data_gen, then heads, train, eval, and export and demo at the top. The entry point
(specheads.cli) dispatches to every stage by name and is not a floor.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
FLOORS = {"core": 0, "data_gen": 1, "heads": 2, "train": 3, "eval": 4, "export": 5, "demo": 5}
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


def test_no_module_imports_from_a_higher_floor():
    sources = {folder: sorted((ROOT / folder).glob("*.py")) for folder in STAGE_FOLDERS}
    sources["core"] = [p for p in sorted((ROOT / "specheads").glob("*.py")) if p.name not in ("cli.py", "__main__.py")]
    upward = []
    for floor, files in sources.items():
        for path in files:
            for name in imports_of(path):
                target = floor_of_module(name)
                if target is not None and FLOORS[target] > FLOORS[floor]:
                    upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, "\n".join(upward)
    assert sum(len(files) for files in sources.values()) > 50  # the walk saw the whole package


def test_no_stage_is_imported_by_its_top_level_name():
    bare = [f"{path.relative_to(ROOT)} imports {name}"
            for folder in (*STAGE_FOLDERS, "specheads", "tests", "benchmarks")
            for path in sorted((ROOT / folder).glob("*.py"))
            for name in imports_of(path) if name.split(".")[0] in STAGE_FOLDERS]
    assert not bare, "\n".join(bare)


def test_metrics_json_is_written_and_read_in_one_module():
    """Every consumer of a report (tuning, export, the card, the demo) goes through eval/report_file.py."""
    holders = []
    for folder in (*STAGE_FOLDERS, "specheads"):
        for path in sorted((ROOT / folder).glob("*.py")):
            constants = [node.value for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)]
            if "metrics.json" in constants:
                holders.append(str(path.relative_to(ROOT)))
    assert holders == ["eval/report_file.py"]
