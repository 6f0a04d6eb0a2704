"""The declared dependencies match what the package imports."""

import ast
import re
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

ROOT = Path(__file__).parents[1]
NOT_IMPORTED = {"gguf", "accelerate", "tensorboard"}  # transformers loads GGUF with them; Lightning logs to tensorboard
EXTRAS = {"vllm": "vllm", "arctic_inference": "suffix", "pydantic": "eagle3"}  # imported only when asked for (module -> the extra of
# pyproject.toml that declares it; pydantic: speculators' config errors, caught where a drafter loads)
NO_DEPS_EXTRAS = {"speculators": "eagle3"}  # the same, installed with --no-deps beside the extra of its dependencies


def test_every_third_party_import_is_declared_and_every_declared_package_is_used():
    imported = set()
    for folder in ("data_gen", "heads", "train", "eval", "export", "demo", "specheads"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name not in ("specheads",)}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert all(re.search(rf'^{extra} = \[.*"{name.replace("_", "-")}', pyproject, re.M) for name, extra in EXTRAS.items())
    third_party -= set(EXTRAS)
    for name, extra in NO_DEPS_EXTRAS.items():
        assert re.search(rf"^{extra} = \[", pyproject, re.M) and f"--no-deps {name}==" in pyproject
    third_party -= set(NO_DEPS_EXTRAS)
    distributions = packages_distributions()
    needed = {distributions[name][0].lower().replace("_", "-") for name in third_party}
    declared = {req.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower().replace("_", "-")
                for req in requires("specheads") if "extra ==" not in req}
    assert needed <= declared, f"imported but not declared: {sorted(needed - declared)}"
    assert declared - needed == NOT_IMPORTED, f"declared but not imported: {sorted(declared - needed - NOT_IMPORTED)}"
