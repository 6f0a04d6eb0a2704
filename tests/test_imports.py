"""The layers of the package: the core under everything, heads on it, the stages side by side on both.

specheads' core (`specheads/`, its decoding package included: models and their placement, prompts, the labelled
dataset's format, checkpoints and reports, the sampling transform, signals, decoding) and the heads (the product's
model code, which the core reads checkpoints into and decodes with) import no stage; each stage (data_gen, train,
eval, export) imports the core, heads and its own modules, never another stage's; demo runs the stages and may
import them all. The entry point (specheads.cli) dispatches to every stage by name and is not a layer.
docs/packages.md draws the same map.
"""

import ast
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
    sources = {folder: sorted((ROOT / folder).glob("*.py")) for folder in STAGE_FOLDERS}
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
            for path in sorted((ROOT / folder).glob("*.py"))
            for name in imports_of(path) if name.split(".")[0] in STAGE_FOLDERS]
    assert not bare, "\n".join(bare)


def test_metrics_json_is_written_and_read_in_one_module():
    """Every consumer of a report (tuning, export, the card, the demo) goes through specheads/report_file.py."""
    holders = []
    for folder in (*STAGE_FOLDERS, "specheads"):
        for path in sorted((ROOT / folder).glob("*.py")):
            constants = [node.value for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)]
            if "metrics.json" in constants:
                holders.append(str(path.relative_to(ROOT)))
    assert holders == ["specheads/report_file.py"]
