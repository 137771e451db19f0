"""The Binder set-up and the links to it, checked without Binder.

binder/requirements.txt pins exact versions that lie inside the ranges CI tests, postBuild
installs kvlib without re-resolving anything, runtime.txt names the Python CI runs, and the
README's badge and per-notebook links follow the documented forms for every notebook.
`make binder-check` then builds that environment for real and runs every notebook in it.
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import set_repo_links
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# What the notebooks import or need to render their widgets in JupyterLab (regex: the BPE
# tokenizers; gguf and jinja2: SmolLM2's file and chat template; postBuild installs kvlib with
# --no-deps, so its dependencies must be pinned here).
NEEDED = {"numpy", "regex", "gguf", "jinja2", "matplotlib", "ipywidgets", "ipykernel", "ipython",
          "jupyterlab", "jupyterlab-widgets", "widgetsnbextension"}
SLUG = r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+"
BRANCH = r"[A-Za-z0-9][A-Za-z0-9_.-]*"  # main, or a tag for a class (make links BRANCH=...)
BADGE = re.compile(
    r"\[!\[Binder\]\(https://mybinder\.org/badge_logo\.svg\)\]"
    rf"\(https://mybinder\.org/v2/gh/({SLUG})/({BRANCH})\?urlpath=lab/tree/notebooks/"
    r"00_big_picture\.ipynb\)")


def requirement_lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def binder_pins() -> dict[str, str]:
    pins = {}
    for line in requirement_lines(BINDER / "requirements.txt"):
        found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)==([0-9][0-9A-Za-z.+!\-]*)", line)
        assert found, f"binder/requirements.txt: {line!r} is not an exact pin name==version"
        pins[canonicalize_name(found.group(1))] = found.group(2)
    return pins


def test_binder_requirements_are_exact_pins_of_everything_the_notebooks_need():
    pins = binder_pins()
    missing = NEEDED - set(pins)
    assert not missing, f"binder/requirements.txt does not pin {sorted(missing)}"
    lines = requirement_lines(BINDER / "requirements.txt")
    assert len(lines) == len(pins), "a package is pinned twice"


def test_binder_pins_lie_inside_the_ranges_ci_tests():
    pins = binder_pins()
    for line in requirement_lines(ROOT / "requirements.txt"):
        if line.startswith("-"):
            continue  # -e . : kvlib itself, installed by postBuild on Binder
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), \
                f"binder pins {name}=={pins[name]}, outside requirements.txt's {requirement}"


def test_postbuild_installs_kvlib_without_resolving_again():
    path = BINDER / "postBuild"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#!/bin/bash\n")
    assert re.search(r"^set -euo pipefail$", text, re.MULTILINE)
    installs = [line for line in text.splitlines() if re.search(r"\bpip install\b", line)]
    assert installs, "postBuild must install kvlib (Binder skips it when binder/ exists)"
    for line in installs:
        assert "--no-deps" in line, f"without --no-deps pip may re-resolve the pins: {line}"
        assert re.search(r"(-e|--editable) \.(\s|$)", line), f"installs kvlib editable: {line}"
    assert os.access(path, os.X_OK), "binder/postBuild must be executable (chmod +x)"


def test_postbuild_fetches_smollm2_and_fails_the_build_without_it():
    text = (BINDER / "postBuild").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if "fetch_smollm2.py" in line]
    assert lines and not any("||" in line for line in lines), \
        "notebooks 18 on need SmolLM2: postBuild must fetch it, and a failure must stop the build"


def test_binder_start_gives_every_kernel_one_blas_thread():
    path = BINDER / "start"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#!/bin/bash\n") and os.access(path, os.X_OK)
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        assert re.search(rf"\b{variable}=1\b", text), variable
    assert text.rstrip().endswith('exec "$@"'), "start must hand over to JupyterLab"


def test_no_other_binder_configuration_overrides_these_files():
    # environment.yml would win over requirements.txt (and ignore runtime.txt)
    for name in ("environment.yml", "Pipfile", "Pipfile.lock", "setup.py", "Project.toml",
                 "install.R", "apt.txt", "Dockerfile"):
        assert not (BINDER / name).exists(), f"binder/{name} changes what Binder builds"


def test_runtime_names_the_python_ci_tests():
    text = (BINDER / "runtime.txt").read_text(encoding="utf-8")
    found = re.fullmatch(r"python-(\d+)\.(\d+)\n?", text)
    assert found, f"binder/runtime.txt should read python-X.Y, got {text!r}"
    runtime = (int(found.group(1)), int(found.group(2)))
    assert runtime >= (3, 10), "pyproject.toml requires Python 3.10 or newer"
    running = sys.version_info[:2]
    if running != runtime and not os.environ.get("CI"):
        pytest.skip(f"binder/runtime.txt names {runtime[0]}.{runtime[1]}, the Python CI tests; "
                    f"this is {running[0]}.{running[1]} (checked for equality in CI only)")
    assert running == runtime, (f"CI runs Python {running[0]}.{running[1]} but Binder would "
                                f"build {runtime[0]}.{runtime[1]}: update binder/runtime.txt")


def readme_with_binder_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    if "mybinder.org" not in text:
        pytest.skip("README.md has no Binder section yet (badge and per-notebook links)")
    return text


def test_readme_badge_opens_jupyterlab_on_notebook_00():
    text = readme_with_binder_section()
    badges = BADGE.findall(text)
    assert len(badges) == 1, "README needs exactly one badge of the documented form"


def test_readme_links_every_notebook_on_nbviewer_and_binder():
    text = readme_with_binder_section()
    ((slug, branch),) = BADGE.findall(text)
    for name in NOTEBOOKS:
        nbviewer = f"https://nbviewer.org/github/{slug}/blob/{branch}/notebooks/{name}.ipynb"
        binder = (f"https://mybinder.org/v2/gh/{slug}/{branch}"
                  f"?urlpath=lab/tree/notebooks/{name}.ipynb")
        assert nbviewer in text, f"README has no nbviewer link for {name}: {nbviewer}"
        assert binder in text, f"README has no Binder link for {name}: {binder}"


def test_readme_links_point_at_one_repository_and_at_notebooks_that_exist():
    text = readme_with_binder_section()
    ((slug, branch),) = BADGE.findall(text)
    links = re.findall(rf"https://mybinder\.org/v2/gh/({SLUG})/({BRANCH})\?urlpath="
                       r"lab/tree/notebooks/([^\s)\]/]+?)\.ipynb", text)
    links += re.findall(rf"https://nbviewer\.org/github/({SLUG})/blob/({BRANCH})/notebooks/"
                        r"([^\s)\]/]+?)\.ipynb", text)
    assert links
    assert {(repo, ref) for repo, ref, _ in links} == {(slug, branch)}, \
        "every link must name the badge's repository and branch"
    everything = re.findall(r"https://(?:mybinder\.org/v2/gh|nbviewer\.org/github)/\S+", text)
    assert len(everything) == len(links), "a Binder or nbviewer link of another form"
    dangling = {name for _, _, name in links} - set(NOTEBOOKS)
    assert not dangling, f"README links notebooks that do not exist: {sorted(dangling)}"


def test_readme_names_the_screenshot_folder_and_the_instructor_guide():
    text = readme_with_binder_section()
    assert "artifacts/screenshots" in text
    assert "docs/instructor-guide.md" in text
    assert "make browser-test" in text and "make binder-check" in text


def guide_sections() -> dict[str, str]:
    guide = (ROOT / "docs" / "instructor-guide.md").read_text(encoding="utf-8")
    parts = re.split(r"^## (\d\d)\b", guide, flags=re.MULTILINE)
    return {number: text for number, text in zip(parts[1::2], parts[2::2])}


def test_instructor_guide_covers_every_notebook():
    sections = guide_sections()
    for name in NOTEBOOKS:
        section = sections.get(name[:2])
        assert section is not None, f"docs/instructor-guide.md has no section for {name}"
        for part in ("**Goals.**", "**Minutes.**", "**Ask the room.**", "**Misconceptions.**",
                     "**Solutions.**"):
            assert part in section, f"the guide's section on {name} has no {part}"


def test_instructor_guide_shows_solutions_the_way_each_notebook_does():
    sections = guide_sections()
    for name in NOTEBOOKS:
        module = ROOT / "kvlib" / "exercises" / f"lesson{name[:2]}.py"
        if not module.exists():
            continue
        section = sections.get(name[:2], "")
        assert f"kvlib/exercises/lesson{name[:2]}.py" in section, name
        notebook = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
        markdown = "".join("".join(c["source"]) for c in notebook["cells"]
                           if c["cell_type"] == "markdown")
        for call in set(re.findall(r"\b(\w+)\.solution\(", markdown)):
            assert f"{call}.solution(" in section, \
                f"{name} tells instructors to call {call}.solution(...); the guide should too"


def test_instructor_guide_names_the_misconceptions_the_issue_lists():
    guide = (ROOT / "docs" / "instructor-guide.md").read_text(encoding="utf-8")
    for misconception in ("Scaling by sqrt(d)", "The reshape in the head split",
                          "Why decode needs no mask", "Why Q is not cached",
                          "Cached output matching only to a tolerance"):
        assert f"**{misconception}" in guide, misconception
    assert "JupyterHub" in guide and "binder/requirements.txt" in guide


def test_make_links_points_every_link_at_a_fork_and_only_those():
    tool = set_repo_links
    text = ("[![Binder](https://mybinder.org/badge_logo.svg)](https://mybinder.org/v2/gh/"
            "OWNER/REPO/main?urlpath=lab/tree/notebooks/00_big_picture.ipynb)\n"
            "| [view](https://nbviewer.org/github/OWNER/REPO/blob/main/notebooks/03_x.ipynb) |\n"
            "See https://github.com/jupyter/nbviewer and OWNER/REPO in prose.\n"
            "git clone https://github.com/OWNER/REPO /srv/series\n")
    once, count = tool.rewrite(text, "alice/kv-cache")
    assert count == 3
    assert "git clone https://github.com/alice/kv-cache /srv/series" in once
    assert "mybinder.org/v2/gh/alice/kv-cache/main?urlpath=lab/tree/notebooks/00_big" in once
    assert "nbviewer.org/github/alice/kv-cache/blob/main/notebooks/03_x.ipynb" in once
    assert "https://github.com/jupyter/nbviewer and OWNER/REPO in prose" in once
    fork, count = tool.rewrite(once, "bob/kv.fork", branch="dev")
    assert count == 3 and "alice" not in fork
    assert "mybinder.org/v2/gh/bob/kv.fork/dev?urlpath=" in fork
    assert "nbviewer.org/github/bob/kv.fork/blob/dev/notebooks/" in fork
    assert tool.rewrite(fork, "bob/kv.fork", branch="dev") == (fork, 3)


@pytest.mark.parametrize("repo", ["alice", "alice/kv/extra", "-alice/kv", "alice/kv cache", ""])
def test_make_links_refuses_what_is_not_owner_slash_name(repo):
    with pytest.raises(ValueError, match="owner/name"):
        set_repo_links.rewrite("https://mybinder.org/v2/gh/OWNER/REPO/main", repo)
