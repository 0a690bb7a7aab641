"""docs/layout.md has one row per module of megatron_async/ (and none for a module that is gone).
Fast tier: reads files only."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_async"
ROW = re.compile(r"^\| `([^`]+)` \|", re.MULTILINE)  # | `run/launch.py` | what it does |


def package_modules() -> set[str]:
    """Every module, as a path under megatron_async/; a sub-package's __init__.py counts as its
    folder row (`run/`), the package's own __init__.py as itself."""
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts:
            continue
        modules.add(f"{rel.parent.as_posix()}/" if rel.name == "__init__.py" and rel.parent.parts else rel.as_posix())
    return modules


def layout_rows() -> set[str]:
    text = (REPO / "docs" / "layout.md").read_text()
    return set(ROW.findall(text)) | {f"{m}" for m in re.findall(r"^\| \*\*`([^`]+/)`\*\* \|", text, re.MULTILINE)}


def test_every_module_has_its_row_in_docs_layout():
    missing = sorted(package_modules() - layout_rows())
    assert not missing, f"docs/layout.md has no row for: {', '.join(missing)}"


def test_every_row_of_docs_layout_names_a_module_that_exists():
    gone = sorted(r for r in layout_rows() if not (PACKAGE / r).exists())
    assert not gone, f"docs/layout.md has rows for modules that do not exist: {', '.join(gone)}"


README_MAX_LINES = 120  # the README is a user's guide; measurement history lives in docs/measurements.md


def test_readme_is_a_short_guide_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, f"README.md has {len(readme.splitlines())} lines"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    broken = sorted({link for link in links if "://" not in link and not (REPO / link).exists()})
    assert not broken, f"README.md links to missing files: {', '.join(broken)}"
