"""kvlib's layers, read from the import statements of every file (imports inside functions too):

- the core (model steps, config, caches, inference, checkpoints) needs numpy only and never
  imports serving, the pictures or the lessons;
- serving sits above the core and below the pictures;
- lesson code (kvlib/exercises/<slug>.py, kvlib/widgets/<slug>.py, one slug a lesson of
  notebooks/lessons.json) is a leaf: no concept module, benchmark or tool imports it, and no
  lesson imports another lesson's module (a lesson's checkers may use its own widgets).
"""

import ast
from pathlib import Path

import lessons
import pytest

ROOT = Path(__file__).resolve().parent.parent

SLUGS = {lesson.slug for lesson in lessons.load()}
LESSON_PACKAGES = ("kvlib.exercises", "kvlib.widgets")
ABOVE_THE_CORE = ("kvlib.serving", "kvlib.plots", "kvlib.hardware", "kvlib.exercises",
                  "kvlib.widgets", "matplotlib", "ipywidgets", "IPython")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module the file imports, absolute (relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def lesson_of(module: str) -> str | None:
    """The slug of a lesson module (kvlib.widgets.paged_cache -> paged_cache), else None."""
    for package in LESSON_PACKAGES:
        if module.startswith(package + ".") and module.split(".")[2] in SLUGS:
            return module.split(".")[2]
    return None


def files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


CORE = [path for path in files("kvlib") if not module_name(path).startswith(
    ("kvlib.serving", "kvlib.exercises", "kvlib.widgets")) and path.stem not in
    ("plots", "hardware")]


def test_every_lesson_module_is_named_by_a_lesson_of_the_table():
    for package in LESSON_PACKAGES:
        folder = ROOT / package.replace(".", "/")
        names = {path.stem for path in folder.glob("*.py")} - {"__init__", "base"}
        assert names <= SLUGS, f"{package} modules that are no lesson's slug: {names - SLUGS}"


@pytest.mark.parametrize("path", files("kvlib/exercises", "kvlib/widgets"), ids=str)
def test_a_lesson_imports_no_other_lesson(path):
    own = lesson_of(module_name(path))
    others = {lesson_of(name) for name in imported(path)} - {None, own}
    assert not others, f"{path.name} imports the lesson modules of {sorted(others)}"


@pytest.mark.parametrize("path", [path for path in files("kvlib", "benchmarks", "tools")
                                  if lesson_of(module_name(path)) is None], ids=str)
def test_no_concept_module_benchmark_or_tool_imports_a_lesson(path):
    lessons_used = {lesson_of(name) for name in imported(path)} - {None}
    assert not lessons_used, f"{path} imports lesson code: {sorted(lessons_used)}"


@pytest.mark.parametrize("path", CORE, ids=str)
def test_the_core_imports_nothing_above_it(path):
    above = {name for name in imported(path) if name.startswith(ABOVE_THE_CORE)}
    assert not above, f"{path} imports {sorted(above)}, which sit above the core"


@pytest.mark.parametrize("path", files("kvlib/serving"), ids=str)
def test_serving_imports_no_pictures_and_no_lessons(path):
    above = {name for name in imported(path) if name.startswith(ABOVE_THE_CORE[1:])}
    assert not above, f"{path} imports {sorted(above)}"


def test_the_pictures_import_no_lessons():
    above = {name for name in imported(ROOT / "kvlib/plots.py")
             if name.startswith(LESSON_PACKAGES)}
    assert not above
