"""The series' one table of lessons, notebooks/lessons.json, and the renumbering that follows it.

Each row is a lesson: its slug (the notebook's name without the number, and the name of its
modules kvlib/exercises/<slug>.py, kvlib/widgets/<slug>.py and tests/test_<slug>.py), its
title (the notebook's first heading), its honest minutes for a first reading with the exercises,
and the one-line summary of README's lesson table. A lesson's number is its place in the list.

    python tools/lessons.py                  # check that the tree agrees with the table
    python tools/lessons.py renumber         # make it agree: rename notebooks, renumber texts
    python tools/lessons.py files LESSON     # a lesson's notebook and tests (LESSON: slug or
                                             # number), for `make test LESSON=...`

To insert a lesson: write notebooks/NN_<slug>.ipynb under any number, add its row where it
belongs in notebooks/lessons.json, run `renumber`, then `make notebooks` (a renumbered text may
be printed by a cell). The notebooks after it are renamed; every "notebook 17" or "lessons
19-23" in the notebooks, README.md, docs/ and the code's texts follows its lesson; README's
table is written again from the table and the instructor's guide's headings and glance rows
are renumbered. Lesson code is named by slug and needs no change.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = "notebooks/lessons.json"
TEXTS = ("README.md", "docs/*.md", "kvlib/**/*.md", "kvlib/**/*.py", "tools/*.py",
         "tools/README.md", "benchmarks/*.py", "tests/*.py", "binder/*")
"""Where, besides the notebooks, a lesson may be named by its number."""


@dataclass(frozen=True)
class Lesson:
    number: int
    slug: str
    title: str
    minutes: str
    summary: str
    memory_mib: int | None = None      # the kernel's peak, measured by tools/measure_memory.py

    @property
    def name(self) -> str:
        """The notebook's file name without .ipynb: 08_kv_cached_decode."""
        return f"{self.number:02d}_{self.slug}"

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.name}.ipynb"

    def heading(self) -> str:
        return f"# {self.number:02d} · {self.title}"


def load(root: Path = ROOT) -> list[Lesson]:
    """The lessons in order, numbered from 00."""
    rows = json.loads((root / TABLE).read_text(encoding="utf-8"))["lessons"]
    return [Lesson(number, row["slug"], row["title"], row["minutes"], row["summary"],
                   row.get("memory_mib")) for number, row in enumerate(rows)]


def find(lesson: str, root: Path = ROOT) -> Lesson:
    """A lesson by slug or number ("kv_cached_decode", "08", "8")."""
    for row in load(root):
        if lesson in (row.slug, row.name) or (lesson.isdigit() and int(lesson) == row.number):
            return row
    raise SystemExit(f"no lesson {lesson!r} in {TABLE}: give a slug or a number")


def lesson_files(lesson: Lesson, root: Path = ROOT) -> list[str]:
    """The lesson's notebook and its test files, as paths from the root."""
    tests = sorted(str(path.relative_to(root))
                   for path in (root / "tests").glob(f"test_{lesson.slug}*.py"))
    return tests + [lesson.notebook]


# ------------------------------------------------------------------------------- README


def readme_rows(lessons: list[Lesson], repo: str = "OWNER/REPO", branch: str = "main") -> str:
    """README's lesson table, one row a lesson, with its nbviewer and Binder links."""
    rows = []
    for lesson in lessons:
        viewer = f"https://nbviewer.org/github/{repo}/blob/{branch}/{lesson.notebook}"
        binder = f"https://mybinder.org/v2/gh/{repo}/{branch}?urlpath=lab/tree/{lesson.notebook}"
        rows.append(f"| {lesson.number:02d} | {lesson.summary} | [nbviewer]({viewer}) | "
                    f"[Binder]({binder}) |")
    return "\n".join(rows)


README_ROW = re.compile(r"^\| \d\d \| .* \| \[nbviewer\]\(https://nbviewer\.org/github/"
                        r"(?P<repo>[^/]+/[^/]+)/blob/(?P<branch>[^/]+)/.*$", re.M)


def readme_table(readme: str) -> tuple[int, int, str, str]:
    """(start, end) of README's lesson rows, and the repository and branch its links name."""
    rows = list(README_ROW.finditer(readme))
    if not rows:
        raise ValueError("README.md has no lesson table")
    return rows[0].start(), rows[-1].end(), rows[0]["repo"], rows[0]["branch"]


def with_readme_rows(readme: str, lessons: list[Lesson]) -> str:
    start, end, repo, branch = readme_table(readme)
    return readme[:start] + readme_rows(lessons, repo, branch) + readme[end:]


# ----------------------------------------------------------------------------- numbers


# "notebook 17", "lessons 19-23", "notebooks 19, 20 and 23", "lesson 08's": a lesson word, then
# numbers joined by commas, "and", "or", "to" or a dash; only the numbers are rewritten
REFERENCE = re.compile(r"\b(?P<word>[Nn]otebooks?|[Ll]essons?) (?P<numbers>\d\d(?:(?:, | and | or "
                       r"| to |-|–)\d\d)*)\b")


def renumber_text(text: str, moved: dict[int, int]) -> str:
    """Every lesson reference of the text with its numbers moved (old -> new), in one pass."""
    def numbers(match: re.Match) -> str:
        new = re.sub(r"\d\d", lambda n: f"{moved.get(int(n[0]), int(n[0])):02d}",
                     match["numbers"])
        return f"{match['word']} {new}"
    return REFERENCE.sub(numbers, text)


def renumber_names(text: str, moved: dict[int, int], slugs: dict[int, str]) -> str:
    """Every notebook file name of a moved lesson (19_paged_cache -> 20_paged_cache)."""
    for old, new in moved.items():
        if old in slugs:
            text = re.sub(rf"\b{old:02d}_{slugs[old]}\b", f"{new:02d}_{slugs[old]}", text)
    return text


def renumber_tables(text: str, moved: dict[int, int]) -> str:
    """The rows of every table of lessons (headed "| notebook |": the guide's glance table,
    notebook 00's map) begin with a lesson's number: move them."""
    lines, in_table = text.split("\n"), False
    for index, line in enumerate(lines):
        if line.startswith("| notebook |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and re.match(r"\| \d\d ", line):
            lines[index] = f"| {moved.get(int(line[2:4]), int(line[2:4])):02d}{line[4:]}"
    return "\n".join(lines)


def renumber_guide(text: str, moved: dict[int, int]) -> str:
    """The guide's headings (## 17 · ...), glance rows (| 17 Title | ...) and references."""
    text = re.sub(r"^(## )(\d\d)( · )", lambda m: f"{m[1]}{moved.get(int(m[2]), int(m[2])):02d}"
                  f"{m[3]}", text, flags=re.M)
    return renumber_text(renumber_tables(text, moved), moved)


def _notebook_of(slug: str, root: Path) -> Path:
    found = sorted((root / "notebooks").glob(f"[0-9][0-9]_{slug}.ipynb"))
    if len(found) != 1:
        raise SystemExit(f"lesson {slug!r}: expected one notebooks/NN_{slug}.ipynb, found "
                         f"{[path.name for path in found]}")
    return found[0]


def _move(source: Path, target: Path, root: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(source)], cwd=root,
                             capture_output=True).returncode == 0
    if tracked:
        subprocess.run(["git", "mv", str(source), str(target)], cwd=root, check=True)
    else:
        source.rename(target)


def _rewrite_notebook(path: Path, moved: dict[int, int], slugs: dict[int, str],
                      heading: str) -> None:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    for index, cell in enumerate(notebook["cells"]):
        text = "".join(cell["source"])
        if index == 0:
            text = re.sub(r"^# \d\d · .*", heading, text, count=1)
        text = renumber_names(renumber_text(renumber_tables(text, moved), moved), moved, slugs)
        cell["source"] = text.splitlines(keepends=True)
    new = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    if new != path.read_text(encoding="utf-8"):
        path.write_text(new, encoding="utf-8")


def renumber(root: Path = ROOT) -> dict[int, int]:
    """Make the tree agree with the table; returns the lessons that moved (old -> new)."""
    lessons = load(root)
    sources = {lesson.slug: _notebook_of(lesson.slug, root) for lesson in lessons}
    moved = {int(sources[lesson.slug].name[:2]): lesson.number for lesson in lessons
             if int(sources[lesson.slug].name[:2]) != lesson.number}
    slugs = {int(sources[lesson.slug].name[:2]): lesson.slug for lesson in lessons}
    # two steps, so that 17 -> 18 never overwrites the 18 that moves on to 19
    staged = {}
    for lesson in lessons:
        source = sources[lesson.slug]
        if source.name != f"{lesson.name}.ipynb":
            staging = source.with_name(f"renumbering-{lesson.name}.ipynb")
            _move(source, staging, root)
            staged[lesson.slug] = staging
    for lesson in lessons:
        if lesson.slug in staged:
            _move(staged[lesson.slug], root / lesson.notebook, root)
    for lesson in lessons:
        _rewrite_notebook(root / lesson.notebook, moved, slugs, lesson.heading())
    for path in sorted({path for pattern in TEXTS for path in root.glob(pattern)}):
        if not path.is_file() or path.name == "lessons.py":
            continue
        text = path.read_text(encoding="utf-8")
        new = renumber_guide(text, moved) if path.name == "instructor-guide.md" else \
            renumber_text(text, moved)
        new = renumber_names(new, moved, slugs)
        if path == root / "README.md":
            new = with_readme_rows(new, lessons)
        if new != text:
            path.write_text(new, encoding="utf-8")
    return moved


# ------------------------------------------------------------------------------ checking


def disagreements(root: Path = ROOT) -> list[str]:
    """Where the tree and the table disagree (empty when they agree)."""
    lessons = load(root)
    found = []
    on_disk = sorted(path.name for path in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    listed = [f"{lesson.name}.ipynb" for lesson in lessons]
    if on_disk != listed:
        found.append(f"notebooks on disk {on_disk} are not the table's {listed}")
    readme = (root / "README.md").read_text(encoding="utf-8")
    if with_readme_rows(readme, lessons) != readme:
        found.append("README.md's lesson table is not the table's (run renumber)")
    bounds = [int(part) for lesson in lessons for part in lesson.minutes.split("-")]
    if lessons and f"{min(bounds)} to {max(bounds)} minutes" not in readme:
        found.append(f"README.md does not say lessons take {min(bounds)} to {max(bounds)} "
                     "minutes, as the table's do")
    for lesson in lessons:
        path = root / lesson.notebook
        if not path.exists():
            continue
        first = "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
        if first.splitlines()[0] != lesson.heading():
            found.append(f"{lesson.notebook} starts {first.splitlines()[0]!r}, the table says "
                         f"{lesson.heading()!r}")
        if f"{lesson.minutes} minutes" not in first:
            found.append(f"{lesson.notebook}'s header does not say its {lesson.minutes} minutes")
        if lesson.memory_mib is not None and f"{lesson.memory_mib:,} MiB" not in first:
            found.append(f"{lesson.notebook}'s header does not say its kernel needs "
                         f"{lesson.memory_mib:,} MiB (python tools/measure_memory.py)")
    return found


def main(argv: list[str]) -> int:
    if argv == ["renumber"]:
        moved = renumber()
        print("renumbered: " + (", ".join(f"{old:02d} -> {new:02d}" for old, new in
                                          sorted(moved.items())) or "nothing moved"))
        return 0
    if len(argv) == 2 and argv[0] == "files":
        print(" ".join(lesson_files(find(argv[1]))))
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    problems = disagreements()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
