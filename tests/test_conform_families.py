"""The conformance suite's layout (rlportable/conform/): one module per contract family (contracts/*.toml)
holding that family's checks and golden cases, every check name unique, and no import cycle among the
suite's modules (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import rlportable.conform as suite
from rlportable.conform import golden
from rlportable.resources import resource_dir

CONFORM = Path(suite.__file__).parent


def test_one_module_per_contract_family():
    families = [module.__name__.rsplit(".", 1)[1] for module in suite.FAMILIES]
    assert sorted(families) == sorted(p.stem for p in (resource_dir("contracts")).glob("*.toml"))
    for module in suite.FAMILIES:
        family = module.__name__.rsplit(".", 1)[1]
        assert module.CHECKS, family
        for name, _ in module.CHECKS:
            assert name == family or name.startswith(f"{family}."), (family, name)
        assert all(case.group == family for case in module.GOLDEN_CASES), family


def test_check_names_are_unique_and_ordered_by_part():
    names = [name for name, _ in suite.CHECKS + suite.EXHAUSTIVE_CHECKS]
    assert len(names) == len(set(names))
    first_golden = next(i for i, name in enumerate(names) if name.startswith("golden."))
    first_e2e = next(i for i, name in enumerate(names) if name.startswith("e2e."))
    assert all(name.startswith("golden.") for name in names[first_golden:first_e2e])
    assert all(name.startswith("e2e.") for name in names[first_e2e:len(suite.CHECKS)])
    assert [name for name, _ in golden.GOLDEN_CHECKS] == [case.check_name for case in golden.CASES]


def _conform_imports(path: Path) -> set[str]:
    """The rlportable.conform modules a module imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlportable.conform"):
            if node.module == "rlportable.conform":
                names |= {f"rlportable.conform.{alias.name}" for alias in node.names
                          if (CONFORM / f"{alias.name}.py").exists()} or {"rlportable.conform"}
            else:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("rlportable.conform")}
    return names


def test_no_import_cycle_among_the_suites_modules():
    graph = {}
    for path in CONFORM.glob("*.py"):
        name = "rlportable.conform" if path.stem == "__init__" else f"rlportable.conform.{path.stem}"
        graph[name] = _conform_imports(path) - {name}
    state: dict[str, str] = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import cycle: {' -> '.join(trail + [node])}"
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            visit(child, trail + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])
