"""Every repository path that README, docs/ and the package's docstrings and comments name exists, so that
text does not outlive the files it points to."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("backends", "bench", "conformance", "contracts", "docs", "rlportable", "scripts", "tests", ".ci", ".github")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./+-]*[\w+])" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"\]\(([^)#\s]+)")
PLACEHOLDER = re.compile(r"[*<>{}]|NNN|/X/|\.\.\.")
GENERATED = ("rlportable/_resources",)  # the wheel build's copy of backends/, contracts/, conformance/
#: the results folders' READMEs record commands as they ran at a past commit (their "tree" column):
#: there only the result files they list must exist
RESULTS_READMES = ("bench/results/README.md", "conformance/results/README.md")


def _texts():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("**/README.md")),
                 *sorted((ROOT / "conformance").glob("**/README.md")), ROOT / "scripts" / "README.md"]:
        yield path, path.read_text()
    for path in (sorted((ROOT / "rlportable").glob("**/*.py")) + sorted((ROOT / "scripts").glob("*.py"))
                 + sorted((ROOT / "tests").glob("**/*.py")) + sorted((ROOT / "contracts").glob("*.toml"))):
        yield path, path.read_text()


def _missing(text: str, where: Path) -> list[str]:
    out = []
    history = str(where.relative_to(ROOT)) in RESULTS_READMES
    for match in PATH.finditer(text):
        name = match.group(1).rstrip(".")
        if PLACEHOLDER.search(text[match.start():match.end() + 1]) or name.startswith(GENERATED):
            continue
        if history and not name.startswith(("bench/results", "conformance/results")):
            continue
        if not (ROOT / name).exists():
            out.append(name)
    if where.suffix == ".md":
        for match in LINK.finditer(text):
            target = match.group(1)
            if "://" in target or target.startswith("mailto:") or PLACEHOLDER.search(target):
                continue
            if not (where.parent / target).exists():
                out.append(target)
    return out


def test_named_paths_exist():
    missing = {str(path.relative_to(ROOT)): names for path, text in _texts() if (names := _missing(text, path))}
    assert not missing, missing
