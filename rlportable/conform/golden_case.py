"""A golden case: a recipe (seed, shapes, parameters) that rebuilds canonical inputs exactly and the
function that computes its named outputs on a backend; and Cases, the list a family declares its
cases in (rlportable.conform.golden collects every family's, in order)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from rlportable.conform.golden_stream import Stream
from rlportable.runtime.base import Backend


@dataclass(frozen=True)
class Case:
    group: str      # the file conformance/golden/<group>.json
    name: str       # the digest's name within the group
    recipe: dict    # JSON: seed, shapes, parameters
    compute: Callable  # compute(backend, stream, recipe) -> [(output name, host array)] in canonical order
    expensive: bool = False  # skipped by --quick

    @property
    def check_name(self) -> str:
        return f"golden.{self.group}.{self.name}"

    def outputs(self, backend: Backend) -> list[tuple[str, np.ndarray]]:
        return self.compute(backend, Stream(self.recipe["seed"]), self.recipe)


class Cases(list):
    """The cases of one group (one digest file), in the order they are declared."""

    def __init__(self, group: str):
        super().__init__()
        self.group = group

    def case(self, name: str, expensive: bool = False, **recipe):
        """Decorator: compute(backend, stream, recipe) becomes the case `name` of this group."""
        def register(compute):
            self.append(Case(self.group, name, json.loads(json.dumps(recipe)), compute, expensive))
            return compute

        return register
