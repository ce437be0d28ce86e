"""What an env or tool exception says about where it came from: the user's file and line.

A failure inside a user's env arrives wrapped in our frames (the episode loop, the env registry) and
often in gymnasium's wrappers or the standard library below the user's code. ``exception_info``
keeps the whole traceback text and names one frame as the failure's *location*: the innermost frame
outside this repository's packages and outside the Python installation (the user's own code); failing
that, the innermost frame outside our packages and the standard library (an installed plug-in); failing
that, the innermost frame (a bug in a built-in env). Everything is a plain string, so it can travel in
``Episode.info`` through pickles, Ray and JSON.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

OUR_PACKAGES = ("envs", "rollout", "rl", "rewards", "model", "kernels")
_ROOT = Path(__file__).resolve().parent.parent
_OURS = tuple(str(_ROOT / p) + "/" for p in OUR_PACKAGES)
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) + "/" for k in ("stdlib", "platstdlib")})
MAX_TRACEBACK_CHARS = 20_000
"""A longer traceback (deep recursion, say) keeps its head and its innermost part."""


def _resolved(filename: str) -> str:
    try:
        return str(Path(filename).resolve())
    except (OSError, ValueError):
        return filename


def _installed(path: str) -> bool:
    return "/site-packages/" in path or "/dist-packages/" in path


def location_frame(tb: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The frame a failure is reported at (see the module docstring); None for an empty traceback."""
    frames = [(f, _resolved(f.filename)) for f in tb]
    not_ours = [(f, p) for f, p in frames if not p.startswith(_OURS) and not p.startswith("<")]
    not_stdlib = [(f, p) for f, p in not_ours if not p.startswith(_STDLIB)]
    for tier in ([(f, p) for f, p in not_stdlib if not _installed(p)], not_stdlib):
        if tier:
            return tier[-1][0]
    return frames[-1][0] if frames else None


def exception_info(e: BaseException) -> dict[str, str]:
    """``error_type``, ``error`` ("Type: message"), ``location`` ("file:line in function", "" when the
    exception carries no traceback), ``code`` (that line's source) and ``traceback`` (the full text)."""
    frame = location_frame(traceback.extract_tb(e.__traceback__))
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if len(text) > MAX_TRACEBACK_CHARS:
        half = MAX_TRACEBACK_CHARS // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return {
        "error_type": type(e).__name__,
        "error": traceback.format_exception_only(type(e), e)[-1].strip(),
        "location": f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else "",
        "code": (frame.line or "").strip() if frame else "",
        "traceback": text,
    }
