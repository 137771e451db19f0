"""The one table of lessons (notebooks/lessons.json): the notebooks, README's lesson table and
the instructor's guide agree with it, and tools/lessons.py renumber inserts a lesson in the
middle by touching the new lesson, the renamed notebooks, the texts that name them by number
and the table."""

import json
import re
import subprocess
from pathlib import Path

import lessons
import pytest

ROOT = Path(__file__).resolve().parent.parent

GUIDE = (ROOT / "docs/instructor-guide.md").read_text(encoding="utf-8")


def test_the_tree_agrees_with_the_table():
    assert lessons.disagreements() == []


@pytest.mark.parametrize("lesson", lessons.load(), ids=lambda lesson: lesson.slug)
def test_the_guide_has_a_section_and_a_glance_row_with_the_minutes(lesson):
    assert re.search(rf"^## {lesson.number:02d} · ", GUIDE, re.M), "no section in the guide"
    row = re.search(rf"^\| {lesson.number:02d} [^|]*\| ([^|]*)\|", GUIDE, re.M)
    assert row and row[1].strip().startswith(lesson.minutes), \
        f"the glance table's minutes for {lesson.name} are not the table's {lesson.minutes}"
    section = GUIDE.split(f"## {lesson.number:02d} · ")[1].split("\n## ")[0]
    assert f"**Minutes.** {lesson.minutes} for a student" in section, \
        f"the guide's section on {lesson.name} does not give the table's {lesson.minutes} minutes"


def test_a_lesson_is_found_by_slug_or_number():
    assert lessons.find("kv_cached_decode") == lessons.find("08") == lessons.find("8")
    assert lessons.lesson_files(lessons.find("08"))[-1] == "notebooks/08_kv_cached_decode.ipynb"
    with pytest.raises(SystemExit, match="no lesson"):
        lessons.find("no_such_lesson")


@pytest.mark.parametrize("lesson", lessons.load(), ids=lambda lesson: lesson.slug)
def test_every_lesson_has_a_test_file_named_by_its_slug(lesson):
    """`make test LESSON=<slug>` runs tests/test_<slug>*.py and the notebook: one file each."""
    assert f"tests/test_{lesson.slug}.py" in lessons.lesson_files(lesson)


def test_references_move_with_their_lessons_in_one_pass():
    moved = {1: 2, 2: 3}
    text = ("notebook 01, notebooks 01-02, lessons 00, 01 and 02, Notebook 02's, "
            "notebook 10 and a date 01-02")
    assert lessons.renumber_text(text, moved) == (
        "notebook 02, notebooks 02-03, lessons 00, 02 and 03, Notebook 03's, "
        "notebook 10 and a date 01-02")


def notebook(heading: str, markdown: str, code: str = "x = 1") -> str:
    text = f"{heading}\n\nAbout 20 minutes.\n{markdown}"
    cells = [{"cell_type": "markdown", "id": "a", "metadata": {},
              "source": text.splitlines(keepends=True)},
             {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": 1,
              "outputs": [], "source": [code]}]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5},
                      indent=1, ensure_ascii=False) + "\n"


def small_series(root: Path) -> None:
    """Three lessons, a README with their table, a guide and a kvlib module naming one."""
    rows = [{"slug": slug, "title": title, "minutes": "20", "summary": title}
            for slug, title in (("first", "First"), ("second", "Second"), ("third", "Third"))]
    (root / "notebooks").mkdir()
    (root / "notebooks/lessons.json").write_text(json.dumps({"lessons": rows}, indent=1))
    for number, row in enumerate(rows):
        (root / f"notebooks/{number:02d}_{row['slug']}.ipynb").write_text(notebook(
            f"# {number:02d} · {row['title']}", "As notebook 02 shows, and notebooks 00-01.\n\n"
            "| notebook | what |\n|---|---|\n| 00 First | a |\n| 02 Third | c |\n\n| 02 | x |"))
    table = lessons.readme_rows(lessons.load(root))
    (root / "README.md").write_text(f"# Series\n\n| | lesson | read | run |\n|---|---|---|---|\n"
                                    f"{table}\n\nStart with notebook 00; the end is lesson 02. "
                                    "Each takes 20 to 20 minutes.\n")
    (root / "docs").mkdir()
    (root / "docs/instructor-guide.md").write_text(
        "| notebook | minutes | idea |\n|---|---|---|\n| 00 First | 20 | a |\n"
        "| 01 Second | 20 | b |\n| 02 Third | 20 | c |\n\n## 00 · First\n\n## 01 · Second\n\n"
        "## 02 · Third\n\nNotebook 01 before notebook 02.\n")
    (root / "kvlib").mkdir()
    (root / "kvlib/lesson_text.py").write_text('HINT = "as notebook 02 showed"\n')
    (root / "tests").mkdir()
    (root / "tests/test_third.py").write_text('NOTEBOOK = "notebooks/02_third.ipynb"\n')
    for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t",
                                                     "commit", "-qm", "three lessons"]):
        subprocess.run(["git", *command], cwd=root, check=True)


def test_inserting_a_lesson_touches_its_own_files_the_renamed_ones_and_the_table(tmp_path):
    small_series(tmp_path)
    table = json.loads((tmp_path / "notebooks/lessons.json").read_text())
    table["lessons"].insert(1, {"slug": "inserted", "title": "Inserted", "minutes": "20",
                                "summary": "Inserted"})
    (tmp_path / "notebooks/lessons.json").write_text(json.dumps(table, indent=1))
    (tmp_path / "notebooks/07_inserted.ipynb").write_text(
        notebook("# 07 · Inserted", "Before notebook 01 comes notebook 00."))

    moved = lessons.renumber(tmp_path)

    assert moved == {1: 2, 2: 3, 7: 1}
    assert lessons.disagreements(tmp_path) == []
    names = sorted(path.name for path in (tmp_path / "notebooks").glob("*.ipynb"))
    assert names == ["00_first.ipynb", "01_inserted.ipynb", "02_second.ipynb", "03_third.ipynb"]
    third = (tmp_path / "notebooks/03_third.ipynb").read_text()
    assert "As notebook 03 shows, and notebooks 00-02." in third
    assert "# 03 · Third" in third
    # a table of lessons moves its numbers, another table keeps its own
    assert "| 00 First | a |\n| 03 Third | c |\n\n| 02 | x |" in "".join(
        json.loads(third)["cells"][0]["source"])
    guide = (tmp_path / "docs/instructor-guide.md").read_text()
    assert "## 03 · Third" in guide and "| 03 Third |" in guide
    assert "Notebook 02 before notebook 03." in guide
    assert "the end is lesson 03" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "kvlib/lesson_text.py").read_text() == 'HINT = "as notebook 03 showed"\n'
    assert (tmp_path / "tests/test_third.py").read_text() == \
        'NOTEBOOK = "notebooks/03_third.ipynb"\n'
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    touched = subprocess.run(["git", "diff", "--cached", "--name-status", "-M"], cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout.split("\n")
    touched = sorted(line.split("\t")[-1] for line in touched if line)
    # the new lesson, the table, the two renamed notebooks, and the texts that name a moved
    # lesson by number or file name (here: 00_first, README, the guide, a hint in kvlib, a test)
    assert touched == ["README.md", "docs/instructor-guide.md", "kvlib/lesson_text.py",
                       "notebooks/00_first.ipynb", "notebooks/01_inserted.ipynb",
                       "notebooks/02_second.ipynb", "notebooks/03_third.ipynb",
                       "notebooks/lessons.json", "tests/test_third.py"]


def test_renumbering_twice_changes_nothing(tmp_path):
    small_series(tmp_path)
    assert lessons.renumber(tmp_path) == {}
    status = subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout
    assert status == ""


def test_the_map_of_the_series_in_the_first_lesson_lists_every_lesson():
    first = json.loads((ROOT / lessons.load()[0].notebook).read_text(encoding="utf-8"))
    text = "".join("".join(cell["source"]) for cell in first["cells"])
    table = text[text.index("| notebook | what it shows |"):].split("\n\n")[0]
    numbers = [int(row[2:4]) for row in table.split("\n")[2:]]
    assert numbers == list(range(len(lessons.load())))
