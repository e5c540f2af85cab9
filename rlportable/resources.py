"""Where the shipped resources live: backends/, contracts/, conformance/.

In a repository checkout (or an editable install) they sit beside the package;
in a wheel they are copied to rlportable/_resources/ (see pyproject.toml).
"""

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_RESOURCE_NAMES = ("backends", "contracts", "conformance")


def resource_dir(name: str) -> Path:
    if name not in _RESOURCE_NAMES:
        raise ValueError(f"unknown resource folder {name!r}; expected one of {_RESOURCE_NAMES}")
    for candidate in (_PACKAGE_DIR / "_resources" / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"rlportable resource folder '{name}' not found in {_PACKAGE_DIR / '_resources'} "
        f"or {_PACKAGE_DIR.parent}: the installation is incomplete"
    )


def portable_source_path(family: str) -> Path | None:
    """backends/portable/<family>.hip: the family's one source for both vendors, or None where the family
    still has a source per vendor."""
    path = resource_dir("backends") / "portable" / f"{family}.hip"
    return path if path.is_file() else None


def kernel_source_path(vendor: str, family: str) -> Path:
    """The source a vendor compiles for a family: backends/portable/<family>.hip where it exists, else
    backends/cuda/<family>.cu or backends/hip/<family>.hip."""
    portable = portable_source_path(family)
    if portable is not None:
        return portable
    suffix = {"cuda": ".cu", "hip": ".hip"}[vendor]
    return resource_dir("backends") / vendor / f"{family}{suffix}"
