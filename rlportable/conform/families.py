"""The conformance module of every contract family (rlportable/conform/<family>.py), in the order
`rlportable conform` runs them: built from the contracts' one list (contract/spec.py `families()`), which
the kernel checks (conform/__init__.py) and the golden cases (conform/golden.py) both iterate, so a family
cannot be in one and silently missing from the other, and a new contract without a module fails to import."""

import importlib

from rlportable.contract import spec

FAMILIES = tuple(importlib.import_module(f"rlportable.conform.{contract.name}") for contract in spec.families())
