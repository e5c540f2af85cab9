"""The scripts stay runnable: each parses, and every name it imports from the package exists (the GPU
scripts cannot run here, but a renamed function must not leave one broken until its next device run)."""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses_and_its_package_imports_exist(script):
    tree = ast.parse(script.read_text(), filename=str(script))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlportable"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                assert hasattr(module, alias.name) or submodule, f"{script.name}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlportable"):
                    importlib.import_module(alias.name)
