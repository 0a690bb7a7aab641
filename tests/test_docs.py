"""docs/layout.md has one row per module of megatron_async/ (and none for a module that is gone).
Fast tier: reads files only."""
import ast
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


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
CODE_DOC_LINK = re.compile(r"\b(docs/[\w.-]+\.md)#([\w-]+)")  # a docs page and anchor named in code or configs


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading suffixed -1, -2, ... (code blocks skipped)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"^#{1,6} (.+)$", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_link(source: Path, target: str) -> str | None:
    """None if `target` (a link written in `source`) resolves inside the repository, else why not."""
    if "://" in target or target.startswith("mailto:"):
        return None
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve() if path else source
    if not resolved.is_relative_to(REPO):
        return f"{target} points outside the repository"
    if not resolved.exists():
        return f"{target}: no such file"
    if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
        return f"{target}: no heading with anchor #{anchor}"
    return None


def test_every_link_of_the_docs_resolves_inside_the_repository():
    broken = [f"{page.relative_to(REPO)}: {why}" for page in DOC_PAGES
              for target in MD_LINK.findall(page.read_text()) if (why := broken_link(page, target))]
    assert not broken, "\n".join(broken)


def test_every_docs_anchor_named_in_code_exists():
    broken = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "launch").glob("*"), *(REPO / "configs").glob("*.yaml"),
                 *(REPO / "tools").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        for page, anchor in CODE_DOC_LINK.findall(path.read_text()):
            if not (REPO / page).exists() or anchor not in heading_anchors(REPO / page):
                broken.append(f"{path.relative_to(REPO)}: {page}#{anchor}")
    assert not broken, "\n".join(broken)


DOC_PAGE_MAX_LINES = 250  # a reference a user reads; dated runs live in docs/measurements.md
LAB_NOTEBOOK = "measurements.md"


def test_every_docs_page_but_the_lab_notebook_is_a_short_reference():
    long = {page.name: n for page in DOC_PAGES[1:]
            if page.name != LAB_NOTEBOOK and (n := len(page.read_text().splitlines())) > DOC_PAGE_MAX_LINES}
    assert not long, f"docs pages over {DOC_PAGE_MAX_LINES} lines (move dated runs to docs/{LAB_NOTEBOOK}): {long}"


MODULE_NAMED = re.compile(r"`([A-Za-z_]\w*)(?:\.py|/|\.\w+)?`|\b([A-Za-z_]\w*)\.py\b")  # `mod`, `mod.py`, `mod.Attr`, `sub/`, mod.py


def test_each_package_docstring_names_every_module_it_holds_and_no_other():
    """A sub-package's __init__ docstring is its table of contents (as docs/layout.md is the
    package's): it names each of its modules and sub-packages, and any `x.py` it names exists."""
    wrong = []
    for init in sorted(PACKAGE.glob("*/**/__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        held = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"} | {
            p.parent.name for p in folder.glob("*/__init__.py")}
        named = {a or b for a, b in MODULE_NAMED.findall(doc)}
        files_named = set(re.findall(r"\b([A-Za-z_]\w*)\.py\b", doc))
        rel = folder.relative_to(PACKAGE)
        if missing := sorted(held - named):
            wrong.append(f"{rel}/__init__.py does not name: {', '.join(missing)}")
        if gone := sorted(files_named - held):
            wrong.append(f"{rel}/__init__.py names modules that do not exist: {', '.join(gone)}")
    assert not wrong, "\n".join(wrong)


def test_no_page_outside_the_repository_is_cited():
    """Docs, code and configs cite only pages a reader of the repository has: every `name.md` they
    mention is a file of the repository or one the package writes (`sweep.md`), and no path climbs
    out of it (`../shared/notes/x.md`)."""
    repo_pages = {p.name for p in REPO.rglob("*.md") if ".venv" not in p.parts}
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    cited = []
    for path in [*DOC_PAGES, *PACKAGE.rglob("*.py"), *(REPO / "configs").glob("*.yaml")]:
        for name in re.findall(r"([\w./-]+\.md)\b", path.read_text()):
            written = f'"{Path(name).name}"' in code
            resolved = [(base / name).resolve() for base in (path.parent, REPO)]
            inside = any(r.is_relative_to(REPO) and r.exists() for r in resolved)
            if (name.startswith("../") and not inside) or (Path(name).name not in repo_pages and not written):
                cited.append(f"{path.relative_to(REPO)}: {name}")
    assert not cited, "\n".join(cited)
