"""The repository stands alone: no file of it points at things a clone does not have.

Every git-tracked text file is searched for references outside the checkout: a sibling folder of it,
design notes that only exist on a development machine, absolute paths of such machines (home
directories, the development work tree) and a task tracker's texts. A hit fails naming the file and
line.
The patterns are assembled from pieces so that this file does not match itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "a sibling folder of the checkout": re.compile(re.escape("../" + "shared")),
    "design notes outside the repository": re.compile(re.escape("DESIGN" + ".md")),
    "an absolute path of a development machine": re.compile(r"(?<![\w.~-])/(?:" + "work|root|home" + r")/"),
    "a task tracker outside the repository": re.compile(r"\b(?:issue" + r" text|issues" + r" show)\b", re.I),
}

# (file, text on the line) pairs that are legitimately absolute paths: the sandbox tests try to
# write to the root user's home on purpose, to check that the sandbox refuses.
ALLOWED = {
    ("tests/envs/test_envs_adversarial.py", "/" + "root/escape.txt"),
}


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file():
            head = path.read_bytes()[:8192]
            if b"\0" not in head:  # binary files (archives, images) hold no references to fix
                files.append(path)
    return files


def _hits(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line) and not any(f == rel and text in line for f, text in ALLOWED):
                out.append(f"{rel}:{lineno}: {what}: {line.strip()[:120]}")
    return out


def test_no_file_refers_outside_the_repository():
    files = _tracked_text_files()
    assert len(files) > 50, f"found only {len(files)} tracked text files"
    hits = [h for f in files for h in _hits(f)]
    assert not hits, "references to things outside the repository:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "line",
    [
        "See `" + "../" + "shared/DESIGN" + ".md` for the design",
        "Exact math: DESIGN" + ".md §3.",
        "(see /" + "work/shared/reference/notes.md)",
        "cp /" + "home/alice/x .",
        "Deviation from the issue " + "text: bf16x3",
    ],
)
def test_the_patterns_catch_what_they_are_for(line):
    assert any(p.search(line) for p in FORBIDDEN.values())


@pytest.mark.parametrize(
    "line",
    [
        "mktemp -d /tmp/lh_ray.XXXXXX",
        "open('/tmp/sandbox/x')",
        "src/work/module.py",
        "~/work/x",
        "docs/design.md",
    ],
)
def test_the_patterns_leave_ordinary_paths_alone(line):
    assert not any(p.search(line) for p in FORBIDDEN.values())
