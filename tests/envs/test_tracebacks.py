"""Where an env failure is reported: the user's frame, past the standard library and our packages."""

import json

from envs.tracebacks import MAX_TRACEBACK_CHARS, exception_info


def _line(fn, text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def users_parser(text):
    return json.loads(text)  # raises inside the standard library's json/decoder.py


def users_env_calling_ours():
    from envs.registry import resolve_env

    return resolve_env("NoSuchEnvAnywhere")  # raises inside envs/registry.py


def caught(fn, *args) -> dict:
    try:
        fn(*args)
    except Exception as e:
        return exception_info(e)
    raise AssertionError("did not raise")


def test_the_location_is_the_users_line_not_the_library_frame_that_raised():
    x = caught(users_parser, "{not json")
    assert x["error_type"] == "JSONDecodeError" and x["error"].startswith("json.decoder.JSONDecodeError: ")
    assert x["location"] == f"{__file__}:{_line(users_parser, 'json.loads(text)')} in users_parser"
    assert x["code"].startswith("return json.loads(text)")
    assert "decoder.py" in x["traceback"]  # the whole traceback is kept

    y = caught(users_env_calling_ours)
    assert y["location"] == f"{__file__}:{_line(users_env_calling_ours, 'resolve_env(')} in users_env_calling_ours"
    assert "envs/registry.py" in y["traceback"]


def test_a_failure_entirely_in_our_code_points_at_its_innermost_frame():
    from envs.registry import resolve_env

    try:
        resolve_env("NoSuchEnvAnywhere")
    except Exception as e:
        e.__traceback__ = e.__traceback__.tb_next  # drop this test's own frame: only ours is left
        x = exception_info(e)
    assert "envs/registry.py:" in x["location"]


def test_long_tracebacks_keep_head_and_innermost_part():
    def huge(n):
        raise ValueError("x" * n)

    x = caught(huge, 3 * MAX_TRACEBACK_CHARS)
    assert len(x["traceback"]) <= MAX_TRACEBACK_CHARS + 100 and "characters cut" in x["traceback"]
    assert x["traceback"].startswith("Traceback") and x["traceback"].rstrip().endswith("xxx")
    assert x["location"].endswith(" in huge") and exception_info(ValueError("no tb"))["location"] == ""
