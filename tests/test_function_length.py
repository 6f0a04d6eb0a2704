"""No function over 60 lines in the stages a reader changes a rule in (issue 73): specheads/, eval/, data_gen/, train/.

A long function is where a newcomer must read a whole round to change one step of it; the splits name the steps (a
round's draft, verify, accept and account; eval's plan, decode and serve)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = ("specheads", "eval", "data_gen", "train")
MOST_LINES = 60


def long_functions(root: Path = ROOT, most: int = MOST_LINES) -> list[str]:
    """Every function (methods and nested ones too) of the four folders longer than `most` lines, decorators not
    counted, as `path:line name (lines)`."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > most:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_walk_finds_a_long_function_nested_in_a_method(tmp_path):
    """The walk sees through classes and nesting, and counts the lines from `def` to the last line of the body."""
    body = "\n".join(f"            x{i} = {i}" for i in range(59))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "m.py").write_text(f"class A:\n    def outer(self):\n        def inner():\n{body}\n"
                                            "        return inner\n")
    for folder in ("specheads", "data_gen", "train"):
        (tmp_path / folder).mkdir()
    assert long_functions(tmp_path) == ["eval/m.py:2 outer (62 lines)"]
    assert long_functions(tmp_path, most=59) == ["eval/m.py:2 outer (62 lines)", "eval/m.py:3 inner (60 lines)"]


def test_no_function_runs_past_60_lines():
    found = long_functions()
    assert not found, f"{len(found)} function(s) over {MOST_LINES} lines; split each where a step has a name:\n" + \
        "\n".join(found)
