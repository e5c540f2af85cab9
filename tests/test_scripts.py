"""The scripts stay runnable: each parses, and every name it imports from the package exists (the GPU
scripts cannot run here, but a renamed function must not leave one broken until its next device run)."""

import ast
import importlib
import importlib.util
import re
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


def test_the_scripts_readme_lists_every_script_and_only_those():
    # a script nobody lists is not maintained; a listed one that is gone misleads
    folder = SCRIPTS[0].parent
    listed = set(re.findall(r"\b[\w-]+\.(?:py|sh|cu)\b", (folder / "README.md").read_text()))
    present = {path.name for path in folder.iterdir() if path.name != "README.md"}
    assert listed == present, {"unlisted": sorted(present - listed), "missing": sorted(listed - present)}


SHELL_SCRIPTS = sorted(SCRIPTS[0].parent.glob("*.sh"))


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=[s.name for s in SHELL_SCRIPTS])
def test_device_run_parses_and_names_scripts_that_exist(script):
    import subprocess

    subprocess.run(["bash", "-n", str(script)], check=True)
    named = set(re.findall(r"scripts/([\w-]+\.(?:py|sh))", script.read_text()))
    assert all((script.parent / name).is_file() for name in named), named
