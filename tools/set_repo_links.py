"""Point the Binder badge and the nbviewer links at a GitHub repository.

    make links REPO=owner/name              # or: python3 tools/set_repo_links.py owner/name
    make links REPO=owner/name BRANCH=dev   # another branch than main

The README (and the instructor's guide) link to Binder and nbviewer in two forms:

    https://mybinder.org/v2/gh/OWNER/REPO/main?urlpath=lab/tree/notebooks/00_big_picture.ipynb
    https://nbviewer.org/github/OWNER/REPO/blob/main/notebooks/00_big_picture.ipynb

This rewrites the owner/name (and the branch) in every such link, whatever they are now: the
placeholder OWNER/REPO, or the repository a fork was copied from; and the GitHub address of
that same repository (https://github.com/OWNER/REPO, for a clone command). Nothing else is
changed.
Standard library only, so that it runs with any Python 3.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("README.md", "docs/instructor-guide.md")
REPO_FORM = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?/[A-Za-z0-9_.-]+")
BRANCH_FORM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SLUG = r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+"
_BRANCH = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
BINDER_LINK = re.compile(rf"https://mybinder\.org/v2/gh/{_SLUG}/{_BRANCH}(?![A-Za-z0-9_.-])")
NBVIEWER_LINK = re.compile(rf"https://nbviewer\.org/github/{_SLUG}/blob/{_BRANCH}/")


def rewrite(text: str, repo: str, branch: str = "main") -> tuple[str, int]:
    """Return `text` with every Binder and nbviewer link pointing at repo and branch, and the
    number of links rewritten."""
    if not REPO_FORM.fullmatch(repo):
        raise ValueError(f"REPO should look like owner/name (GitHub's form), got {repo!r}")
    if not BRANCH_FORM.fullmatch(branch):
        raise ValueError(f"BRANCH should be a plain branch name such as main, got {branch!r}")
    # the repository these links name now, so that its own GitHub address moves with them
    current = set(re.findall(rf"https://mybinder\.org/v2/gh/({_SLUG})/", text))
    current |= set(re.findall(rf"https://nbviewer\.org/github/({_SLUG})/blob/", text))
    text, binder = BINDER_LINK.subn(f"https://mybinder.org/v2/gh/{repo}/{branch}", text)
    text, nbviewer = NBVIEWER_LINK.subn(f"https://nbviewer.org/github/{repo}/blob/{branch}/", text)
    github = 0
    for old in current:
        text, n = re.subn(rf"https://github\.com/{re.escape(old)}(?![A-Za-z0-9_-])",
                          f"https://github.com/{repo}", text)
        github += n
    return text, binder + nbviewer + github


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", help="owner/name of the GitHub repository, e.g. alice/kv-cache")
    parser.add_argument("--branch", default="main", help="the branch to open (default: main)")
    args = parser.parse_args(argv)
    total = 0
    for relative in FILES:
        path = ROOT / relative
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        try:
            new, count = rewrite(text, args.repo, args.branch)
        except ValueError as error:
            parser.error(str(error))
        if new != text:
            path.write_text(new, encoding="utf-8")
        print(f"{relative}: {count} links point at {args.repo} ({args.branch})")
        total += count
    if total == 0:
        print("no Binder or nbviewer links found to rewrite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
