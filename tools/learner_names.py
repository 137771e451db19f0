"""The names of kvlib that a learner calls: the fuzz contract's scope (tests/fuzz_api_cases.py).

Read, not guessed: every code cell of notebooks/*.ipynb, and every exercise's solution (the
SOLUTIONS of kvlib/exercises/<slug>.py: the code a learner writes, run in the notebook's
namespace), parsed with ast. A name is in the list when the code

- reaches it through a kvlib module (`kvlib.prefill`, `roofline.decode_step_bytes` after
  `from kvlib import roofline`, `kvlib.serving.batch.left_pad`), or imports it from one
  (`from kvlib.serving import PrefixServer`), or
- calls a method of one of kvlib's public classes by name on any object (`cache.append(...)`,
  `params.with_config(...)`): which object is not known without running the code, so every
  public class of the listed modules whose own method has that name counts.

Lesson modules (kvlib.exercises, kvlib.widgets: their checkers and widgets answer in words
by themselves, tests/checker_cases.py fuzzes them) and the pictures (kvlib.plots) are left
out. Names are printed as module.qualname, where the function or class is defined:

    python tools/learner_names.py            # the list, one name a line
    python tools/learner_names.py --where    # with the notebooks and solutions that call each
    python tools/learner_names.py --module > tests/fuzz_scope.py    # the fuzz's scope
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = ("kvlib.exercises", "kvlib.widgets", "kvlib.plots")


def sources() -> list[tuple[str, str, str]]:
    """(where, notebook stem, code) for every code cell and every exercise solution."""
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for number, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                found.append((f"{path.stem} cell {number}", path.stem, "".join(cell["source"])))
        slug = path.stem.split("_", 1)[1]
        exercises = importlib.import_module(f"kvlib.exercises.{slug}")
        for number, code in getattr(exercises, "SOLUTIONS", {}).items():
            found.append((f"{path.stem} solution {number}", path.stem, code))
    return found


def _parse(code: str) -> ast.Module:
    # notebook magics (%timeit, !pip) are not Python
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines()]
    return ast.parse("\n".join(lines))


def _aliases(tree: ast.Module, aliases: dict) -> None:
    """Names bound to kvlib modules or objects by the import statements of a cell."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvlib":
                    top = alias.name.split(".")[0]
                    aliases[alias.asname or top] = importlib.import_module(
                        alias.name if alias.asname else top)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlib"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(module, alias.name, None)
                if value is None:
                    value = importlib.import_module(f"{node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = value


def _chain(node: ast.AST) -> list[str] | None:
    """['kvlib', 'serving', 'batch', 'left_pad'] for kvlib.serving.batch.left_pad."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _kvlib_object(value) -> str | None:
    """module.qualname of a function or class defined in kvlib (not a lesson module)."""
    if inspect.ismodule(value) or not (inspect.isfunction(value) or inspect.isclass(value)):
        return None
    module = getattr(value, "__module__", "") or ""
    if not module.startswith("kvlib") or module.startswith(LEFT_OUT):
        return None
    return f"{module}.{value.__qualname__}"


def _methods_by_name(classes: set[type]) -> dict[str, set[str]]:
    """method name -> {module.Class.method} over the classes' public methods, named where
    they are defined (BaseKVCache.reset), or through the public class when they are defined
    in a private base class."""
    methods = defaultdict(set)
    for cls in classes:
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") or _kvlib_object(member) is None:
                continue
            owner = member.__qualname__.rsplit(".", 1)[0]
            where = cls.__qualname__ if owner.startswith("_") else owner
            methods[name].add(f"{member.__module__}.{where}.{name}")
    return methods


def learner_names() -> dict[str, set[str]]:
    """Every name the notebooks and solutions call -> where it is called."""
    where = defaultdict(set)
    called_attributes = defaultdict(set)
    aliases_by_notebook: dict[str, dict] = defaultdict(dict)
    modules, reached = set(), []
    for place, notebook, code in sources():
        tree = _parse(code)
        aliases = aliases_by_notebook[notebook]
        _aliases(tree, aliases)
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlib"):
                for alias in node.names:
                    value = aliases.get(alias.asname or alias.name)
                    if _kvlib_object(value):
                        where[_kvlib_object(value)].add(place)
                        reached.append(value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                called_attributes[node.func.attr].add(place)
            if not isinstance(node, (ast.Attribute, ast.Name)) or id(node) in inner:
                continue                      # the longest chain only: a.b.c, not a.b
            chain = _chain(node)
            if not chain or chain[0] not in aliases:
                continue
            value = aliases[chain[0]]
            for part in [*chain[1:], None]:
                if inspect.ismodule(value) and not value.__name__.startswith(LEFT_OUT):
                    modules.add(value)                  # its public classes' methods count
                if part is None or not (inspect.ismodule(value) or inspect.isclass(value)):
                    break
                value = getattr(value, part, None)     # a module's name, or a class's method
            name = _kvlib_object(value)
            if name:
                where[name].add(place)
                reached.append(value)
    classes = {value for module in modules for value in vars(module).values()
               if inspect.isclass(value) and _kvlib_object(value) and
               not value.__name__.startswith("_")}
    classes |= {value for value in reached if inspect.isclass(value)}
    for method, qualnames in _methods_by_name(classes).items():
        for qualname in qualnames:
            if method in called_attributes:
                where[qualname] |= called_attributes[method]
    return dict(where)


SCOPE_MODULE = '''"""The fuzz contract's scope: every name of kvlib a learner calls (test_fuzz.py).

Made by tools/learner_names.py, which reads the code cells of notebooks/*.ipynb and the
exercises' solutions (what a learner writes, in the notebook's namespace) and lists the kvlib
functions, classes and methods they reach; tests/test_fuzz.py checks that this list is still
what the tool finds. After a notebook or a solution changes, remake it:

    python tools/learner_names.py --module > tests/fuzz_scope.py

Lesson modules (kvlib.exercises, kvlib.widgets) and the pictures (kvlib.plots) are not in it.
kvlib.serving's names are, but its fuzz cases are its own (tests/fuzz_api_cases.py).
"""

LEARNER_NAMES = (
{names})
'''


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    found = learner_names()
    if "--module" in sys.argv:
        print(SCOPE_MODULE.format(names="".join(f'    "{name}",\n' for name in sorted(found))),
              end="")
    for name in sorted(found) if "--module" not in sys.argv else ():
        if "--where" in sys.argv:
            print(f"{name}: {', '.join(sorted(found[name])[:4])}"
                  f"{' ...' if len(found[name]) > 4 else ''}")
        else:
            print(name)
