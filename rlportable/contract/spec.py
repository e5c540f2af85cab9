"""Contract files (contracts/<family>.toml): schema, loading and validation.

A contract names what an op family computes to the bit, its reference (a
Python function), and its kernels. `validate` checks that every named piece
exists: the reference functions import, both vendors' sources exist and define
every named kernel as an extern "C" __global__ entry point. The sources are not
named in the file: each vendor compiles the one `resources.kernel_source_path`
gives (its fast-path file where it has one, else backends/portable/<family>.hip).

`families()` is the one list of kernel families: the contracts in their `order`,
which conform's checks, the golden cases and the build tools all iterate.

A family whose kernels are not written yet says so in `reference_only` (what
is missing, one line) and has no source; its ops name no kernels, and the ops
refuse every backend but the reference rather than fall back to it.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rlportable.errors import ContractError
from rlportable.resources import assemble_text, kernel_source_path, portable_source_path, resource_dir

FAMILY_KEYS = {"name", "summary", "reference", "order"}
# a source path in the file would repeat resources.kernel_source_path's rule, and could drift from it
NAMED_SOURCE_KEYS = {"cuda_source", "hip_source"}
OP_KEYS = {"name", "summary", "reference", "kernels", "computes", "inputs", "outputs", "params",
           "invariances", "edge_cases"}
KNOWN_INVARIANCES = {
    "batch", "row_permutation", "position_in_batch", "k_sharding", "launch_shape", "vendor",
    "elementwise", "prefill_decode", "kv_block_size", "tp_degree", "expert_grouping",
}


@dataclass
class Op:
    name: str
    summary: str
    reference: str
    kernels: list[str]
    computes: str
    inputs: list[dict]
    outputs: list[dict]
    params: dict
    invariances: list[str]
    edge_cases: dict


@dataclass
class Contract:
    path: Path
    name: str
    summary: str
    reference: str
    #: the family's place in `rlportable conform` and in the golden cases (encodings and sums first)
    order: int
    ops: list[Op]
    extra_kernels: list[str] = field(default_factory=list)
    #: speed-only kernels with no HIP counterpart yet (each equal to the reference, checked by conform)
    cuda_only_kernels: list[str] = field(default_factory=list)
    #: AMD's speed-only kernels (backends/hip: MFMA), each built only for the targets with its instruction
    hip_only_kernels: list[str] = field(default_factory=list)
    #: a family with no kernels yet: what is missing (its sources are None)
    reference_only: str | None = None

    def all_kernels(self) -> list[str]:
        return [k for op in self.ops for k in op.kernels] + list(self.extra_kernels)

    def source(self, vendor: str) -> Path | None:
        """The file a vendor ("cuda" or "hip") compiles for this family; None for a reference_only one."""
        return None if self.reference_only is not None else kernel_source_path(vendor, self.name)


def contract_paths() -> list[Path]:
    return sorted(resource_dir("contracts").glob("*.toml"))


def load(path: Path) -> Contract:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ContractError(f"{path}: cannot read contract: {error}") from None
    family = data.get("family")
    if not isinstance(family, dict):
        raise ContractError(f"{path}: missing [family] table")
    reference_only = family.get("reference_only")
    if NAMED_SOURCE_KEYS & set(family):
        raise ContractError(f"{path}: [family] names {', '.join(sorted(NAMED_SOURCE_KEYS & set(family)))}; a "
                            f"family's sources are backends/portable/{path.stem}.hip and its vendors' fast-path files")
    _require_keys(path, "[family]", family, FAMILY_KEYS)
    if family["name"] != path.stem:
        raise ContractError(f"{path}: family name {family['name']!r} differs from the file name {path.stem!r}")
    raw_ops = data.get("op")
    if not isinstance(raw_ops, list) or not raw_ops:
        raise ContractError(f"{path}: no [[op]] entries")
    ops = []
    for index, raw in enumerate(raw_ops):
        _require_keys(path, f"[[op]] #{index + 1}", raw, OP_KEYS)
        unknown = set(_invariance_names(raw["invariances"])) - KNOWN_INVARIANCES
        if unknown:
            raise ContractError(f"{path}: op {raw['name']!r} lists unknown invariances {sorted(unknown)}")
        if reference_only is not None and raw["kernels"]:
            raise ContractError(f"{path}: op {raw['name']!r} names kernels in a reference_only family")
        ops.append(Op(**{key: raw[key] for key in OP_KEYS}))
    return Contract(path=path, name=family["name"], summary=family["summary"], reference=family["reference"],
                    order=family["order"], ops=ops,
                    extra_kernels=list(family.get("extra_kernels", [])),
                    cuda_only_kernels=list(family.get("cuda_only_kernels", [])),
                    hip_only_kernels=list(family.get("hip_only_kernels", [])),
                    reference_only=reference_only)


def _invariance_names(invariances: list[str]) -> list[str]:
    """'batch: a row's result ...' -> 'batch'."""
    return [item.split(":", 1)[0].strip() for item in invariances]


def _require_keys(path: Path, where: str, table: dict, keys: set[str]) -> None:
    missing = sorted(keys - set(table))
    if missing:
        raise ContractError(f"{path}: {where} lacks {', '.join(missing)}")


def load_all() -> list[Contract]:
    return [load(path) for path in contract_paths()]


def families() -> list[Contract]:
    """Every contract, in its `order`: the one list of kernel families (a new contracts/<f>.toml joins
    conform, the golden cases and the build tools by existing)."""
    contracts = sorted(load_all(), key=lambda c: c.order)
    orders = [c.order for c in contracts]
    if len(set(orders)) != len(orders):
        raise ContractError(f"two contracts share an order: {[(c.name, c.order) for c in contracts]}")
    return contracts


def kernel_families() -> list[str]:
    """The families with kernel sources (every one but the reference_only), by name."""
    return sorted(c.name for c in load_all() if c.reference_only is None)


def validate(contract: Contract) -> None:
    """Raise ContractError unless every piece the contract names exists."""
    module = _import_reference(contract)
    for op in contract.ops:
        if not callable(getattr(module, op.reference, None)):
            raise ContractError(f"{contract.path}: reference {contract.reference}.{op.reference} does not exist")
    if contract.reference_only is not None:
        if contract.all_kernels() or contract.cuda_only_kernels or contract.hip_only_kernels:
            raise ContractError(f"{contract.path}: a reference_only family names kernels")
        if portable_source_path(contract.name).is_file():
            raise ContractError(f"{contract.path}: a reference_only family has a kernel source, "
                                f"{portable_source_path(contract.name)}")
        return
    root = resource_dir("backends").parent
    for vendor in ("cuda", "hip"):
        source = contract.source(vendor)
        relative = source.relative_to(root).as_posix()
        if not source.is_file():
            raise ContractError(f"{contract.path}: {vendor} source {relative} does not exist")
        text = assemble_text(source.read_text(), folder=source.parent)  # a fast-path file includes the portable one
        defined = set(kernel_entry_points(text))
        for kernel in contract.all_kernels():
            if kernel not in defined:
                raise ContractError(f"{contract.path}: kernel {kernel!r} is not an extern \"C\" __global__ entry point of {relative}")
        only = contract.cuda_only_kernels if vendor == "cuda" else contract.hip_only_kernels
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)  # a name in a comment defines nothing
        for kernel in only:
            # defined through an entry macro, e.g. RLP_GEMM_FUSED_ENTRY(name, ...)
            if not re.search(rf"\b{kernel}\b", code):
                raise ContractError(f"{contract.path}: {vendor}-only kernel {kernel!r} does not appear in {relative}")


def _import_reference(contract: Contract):
    try:
        return importlib.import_module(contract.reference)
    except ImportError as error:
        raise ContractError(f"{contract.path}: reference module {contract.reference} does not import: {error}") from None


_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:(?:__launch_bounds__|RLP_LAUNCH_BOUNDS)\([^)]*\)\s+)?(\w+)\s*\(')


def kernel_entry_points(source: str) -> list[str]:
    return _ENTRY.findall(source)
