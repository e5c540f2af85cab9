"""Where the shipped resources live: backends/, contracts/, conformance/.

In a repository checkout (or an editable install) they sit beside the package;
in a wheel they are copied to rlportable/_resources/ (see pyproject.toml).
"""

import re
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_RESOURCE_NAMES = ("backends", "contracts", "conformance")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


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


VENDOR_SUFFIX = {"cuda": ".cu", "hip": ".hip"}


def portable_source_path(family: str) -> Path:
    """backends/portable/<family>.hip: the family's one source for both vendors."""
    return resource_dir("backends") / "portable" / f"{family}.hip"


def vendor_source_path(vendor: str, family: str) -> Path | None:
    """backends/cuda/<family>.cu or backends/hip/<family>.hip: a vendor's fast paths of a family (kernels
    only that vendor runs), which include the portable source; None where the vendor has none."""
    path = resource_dir("backends") / vendor / f"{family}{VENDOR_SUFFIX[vendor]}"
    return path if path.is_file() else None


def kernel_source_path(vendor: str, family: str) -> Path:
    """The source a vendor compiles for a family: its fast-path file where it has one (which includes the
    portable source), else the portable source."""
    return vendor_source_path(vendor, family) or portable_source_path(family)


def assemble_text(text: str, prelude: str | None = None, folder: Path | None = None) -> str:
    """Kernel source text with its local includes inlined: headers from `folder`, then
    backends/portable; `prelude` (a path under backends/) in front."""
    backends = resource_dir("backends")
    folders = ((folder,) if folder is not None else ()) + (backends / "portable",)
    if prelude is not None:
        text = _inline_includes(f'#include "{prelude}"', (backends,), seen=set()) + "\n" + text
    return _inline_includes(text, folders, seen=set())


def _inline_includes(text: str, folders: tuple[Path, ...], seen: set[str]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return f"// (already included: {name})"
        seen.add(name)
        included = next((folder / name for folder in folders if (folder / name).is_file()), None)
        if included is None:
            raise FileNotFoundError(f"{folders[0]}: included header {name} is missing")
        return f"// ---- begin {name}\n{_inline_includes(included.read_text(), folders, seen)}\n// ---- end {name}"

    return _LOCAL_INCLUDE.sub(replace, text)
