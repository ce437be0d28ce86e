"""Adversarial catalogue: every action must give a readable error observation within its time budget,
leave the env usable (the expert still solves the task afterwards) and leak nothing to the host."""

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from envs_helpers import FAST_SANDBOX, make_env

from envs import protocol
from envs.sandbox import SANDBOX_UIDS, namespace_mode  # SANDBOX_UIDS: the throw-away uids
from envs.sandbox_common import processes_of_uid

TC = protocol.format_tool_call
SECRET_VALUE = f"host-secret-{uuid.uuid4().hex}"


def raw(body: str) -> str:
    return protocol.TOOL_CALL_START + body + protocol.TOOL_CALL_END


def calc(expression) -> str:
    return raw(json.dumps({"name": "calculator", "arguments": {"expression": expression}}))


def py(code: str) -> str:
    return TC("python", {"code": code})


@dataclass
class Case:
    id: str
    env: str
    action: object
    fragment: str  # must appear (case-insensitive) in the error observation; "a|b": either
    budget_s: float = 2.0


CALC_CASES = [
    Case("bad_json", "Calculator", raw('{"name": "calculator", "arguments": {'), "not valid JSON"),
    Case("not_object", "Calculator", raw("[1, 2, 3]"), "must be a JSON object"),
    Case("missing_name", "Calculator", raw('{"arguments": {"expression": "1"}}'), 'needs a "name"'),
    Case("name_not_string", "Calculator", raw('{"name": 5, "arguments": {}}'), 'needs a "name"'),
    Case("unknown_tool", "Calculator", TC("shell", {"cmd": "rm -rf /"}), "unknown tool 'shell'"),
    Case("args_list", "Calculator", raw('{"name": "calculator", "arguments": [1]}'), "must be a JSON object"),
    Case("args_bad_string", "Calculator", raw('{"name": "calculator", "arguments": "{x"}'), "arguments string"),
    Case("wrong_type", "Calculator", calc(12), "must be string, got integer"),
    Case("missing_arg", "Calculator", TC("calculator", {}), "missing required"),
    Case("extra_arg", "Calculator", TC("calculator", {"expression": "1", "mode": "x"}), "unexpected key"),
    Case("extra_top_key", "Calculator", raw('{"name": "calculator", "arguments": {}, "x": 1}'), "unexpected keys"),
    Case("oversized", "Calculator", calc("1+" * 20_000 + "1"), "too large"),
    Case("too_long_arg", "Calculator", calc("1+" * 150 + "1"), "longer than 200"),
    Case("missing_close", "Calculator", '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "missing closing"),
    Case("many_calls", "Calculator", calc("1 + 1") * 30, "too many tool calls"),
    Case("lone_surrogate", "Calculator", "<tool_call>\ud83d</tool_call>", "lone surrogate"),
    Case("invalid_utf8_bytes", "Calculator", b"\xc3\x28" + calc("1").encode(), "not valid UTF-8"),
    Case("nul_bytes", "Calculator", raw('{"name": "calc\x00ulator", "arguments": {}}'), "not valid JSON"),
    Case("deep_nesting", "Calculator", raw("[" * 5000 + "]" * 5000), "not valid JSON"),
    Case("empty_call", "Calculator", raw(""), "not valid JSON"),
    Case("nested_tags", "Calculator", raw(raw("{}")), "not valid JSON"),
    Case("nan_argument", "Calculator", raw('{"name": "calculator", "arguments": {"expression": NaN}}'), "NaN"),
    Case("power_tower", "Calculator", calc("9**9**9"), "exponent"),
    Case("huge_product", "Calculator", calc("99999999999**2*99999999999**2*99999999999"), "too large"),
    Case("huge_literal", "Calculator", calc("1e999 * 2"), "too large"),
    Case("division_by_zero", "Calculator", calc("1/0"), "division by zero"),
    Case("code_injection", "Calculator", calc("__import__('os').system('touch /tmp/pwned')"), "unsupported syntax"),
    Case("garbage_expression", "Calculator", calc("1 +* 2 ☃"), "cannot parse"),
    Case("role_user_message", "Calculator", {"role": "user", "content": "hi"}, "role 'assistant'"),
    Case("content_not_str", "Calculator", {"role": "assistant", "content": ["x"]}, "must be a str"),
    Case("action_int", "Calculator", 12345, "must be a str"),
    Case("action_none", "Calculator", None, "must be a str"),
    Case("bad_chat_tool_calls", "Calculator", {"role": "assistant", "content": "", "tool_calls": [7]}, "malformed tool_calls"),
    Case("bad_chat_tool_args", "Calculator",
         {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": "{oops"}}]}, "malformed tool_calls"),
    Case("frozenlake_bad_direction", "FrozenLake", TC("move", {"direction": "north"}), "must be one of"),
    Case("countdown_foreign_number", "Countdown", TC("evaluate", {"expression": "1000 + 1000"}), "not available"),
    Case("search_wrong_type", "RetrievalQA", TC("search", {"query": ["a"]}), "must be string"),
]  # fmt: skip


def _sandbox_cases(secret_path: str, host_port: int) -> list[Case]:
    w = FAST_SANDBOX["wall_s"]
    return [
        Case("infinite_loop", "Python", py("while True:\n    pass"), "CPU time limit|wall-clock timeout", w + 3),
        Case("sleep_forever", "Python", py("import time\ntime.sleep(1000)"), "wall-clock timeout", w + 3),
        Case("fork_bomb", "Python", py("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
             "", w + 3),
        Case("allocate_10gb", "Python", py("x = bytearray(10 * 1024**3)"), "MemoryError", w + 3),
        Case("huge_file", "Python", py("with open('big', 'wb') as f:\n    f.write(b'0' * (200 * 1024**2))"), "", w + 3),
        Case("write_outside_tmp", "Python", py(f"open('/tmp/{uuid.uuid4().hex}-escape', 'w').write('x')\n"
             f"import os; assert os.path.exists('/tmp/sandbox'); raise SystemExit(7)"), "exit code 7", w + 3),
        Case("write_into_repo", "Python", py(f"open('{Path(__file__).parent}/escape.txt', 'w').write('x')"),
             "Errno", w + 3),
        Case("write_root_home", "Python", py("open('/root/escape.txt', 'w').write('x')"), "Errno", w + 3),
        Case("read_host_secret", "Python", py(f"print(open({secret_path!r}).read())"), "Errno", w + 3),
        Case("read_etc_shadow", "Python", py("print(open('/etc/shadow').read())"), "Permission denied", w + 3),
        Case("socket_to_host", "Python", py(f"import socket\nsocket.create_connection(('127.0.0.1', {host_port}), timeout=1)"),
             "Error", w + 3),
        Case("socket_internet", "Python", py("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)"),
             "Error", w + 3),
        Case("kill_parent", "Python", py("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nraise SystemExit(3)"),
             "exit code", w + 3),
        Case("kill_host_process", "Python", py(f"import os\nos.kill({os.getpid()}, 9)"), "Error", w + 3),
        Case("kill_all", "Python", py("import os\nos.kill(-1, 9)"), "", w + 3),
        Case("flood_stdout", "Python", py("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"), "", w + 3),
        Case("host_env_vars", "Python", py("import os, sys\nprint(sorted(os.environ))\nsys.exit(int('LH_SECRET' in os.environ) + 4)"),
             "exit code 4", w + 3),
        Case("daemon_left_behind", "Python", py("import subprocess, sys\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\n"
             "sys.exit(9)"), "exit code 9", w + 3),
        Case("syntax_error", "Python", py("def f(:\n  pass"), "SyntaxError", w + 3),
        Case("oversized_code", "Python", py("x = 1\n" * 3000), "too large", 2.0),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def host_fixtures():
    # a root-only secret outside any temp dir, and a listening socket on the host's loopback
    secret = Path(__file__).parent / f".secret-{uuid.uuid4().hex}"
    secret.write_text(SECRET_VALUE)
    secret.chmod(0o600)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    os.environ["LH_SECRET"] = SECRET_VALUE
    yield str(secret), server
    os.environ.pop("LH_SECRET", None)
    server.close()
    secret.unlink()


def _record_uids(sandbox) -> list[int | None]:
    """The host uids of ``sandbox``'s calls from now on (a spy: the real ``run_python`` runs)."""
    uids: list[int | None] = []
    real = sandbox.run_python

    def run_python(*args, **kwargs):
        result = real(*args, **kwargs)
        uids.append(result.host_uid)
        return result

    sandbox.run_python = run_python
    return uids


def _left_behind(uids: list[int | None]) -> list[int]:
    """Live (or unreaped) processes of the throw-away uids these calls ran as. Each call draws its
    own uid, so another test's sandbox calls running beside this one (another pytest worker) are
    never counted, whichever backend they use."""
    return [pid for uid in sorted({u for u in uids if u is not None}) for pid in processes_of_uid(uid)]


def _assert_uids_were_dropped(uids: list[int | None]) -> None:
    """As root every call runs as a throw-away uid: the leak check above has something to check."""
    if os.geteuid() == 0:
        assert uids and all(u in SANDBOX_UIDS for u in uids), uids


def _check_case(case: Case, env) -> dict:
    env.reset(seed=3, options={"difficulty": 1})
    t0 = time.monotonic()
    obs, reward, terminated, truncated, info = env.step(case.action)
    assert not truncated
    elapsed = time.monotonic() - t0
    assert elapsed <= case.budget_s, f"{case.id}: took {elapsed:.1f} s > {case.budget_s} s"
    errors = [m["content"] for m in obs["messages"] if m["content"].startswith("error:")]
    assert errors, f"{case.id}: no error observation in {obs['messages']}"
    wanted = case.fragment.lower().split("|")
    assert any(w in e.lower() for e in errors for w in wanted), f"{case.id}: {errors}"
    assert SECRET_VALUE not in json.dumps(obs) and reward == 0.0 and not terminated
    while not env.done:  # the env is still usable: the expert finishes and solves the task
        _, _, _, _, info = env.step(env.expert_action())
    assert info["solved"], f"{case.id}: env unusable after the attack: {env.messages[-3:]}"
    return info


def test_catalogue_is_large_enough():
    assert len(CALC_CASES) + len(_sandbox_cases("/x", 1)) >= 40


@pytest.mark.parametrize("case", CALC_CASES, ids=lambda c: c.id)
def test_malformed_actions_give_error_observations(case):
    _check_case(case, make_env(case.env))


def test_step_before_reset_and_after_end_never_raise():
    env = make_env("Calculator")
    r = env.step("hello")
    assert r.terminated and r.obs["messages"][0]["content"].startswith("error: step() called before reset()")
    env.reset(seed=0)
    env.step("<answer>1</answer>")
    r = env.step(env.expert_action())
    assert r.terminated and "episode has ended" in r.obs["messages"][0]["content"]


@pytest.mark.skipif(namespace_mode() == "none", reason="needs Linux namespaces (unshare)")
def test_sandbox_reports_its_protections():
    env = make_env("Python")
    _, info = env.reset(seed=0)
    prot = info["sandbox"]
    assert prot["network"] == "isolated" and {"net", "pid", "mount"} <= set(prot["namespaces"])
    if os.geteuid() == 0:
        assert prot["uid"] == "unprivileged throw-away uid"


@pytest.mark.skipif(
    namespace_mode() == "none", reason="no Linux namespaces here: the sandbox cannot isolate network and /tmp"
)
def test_sandboxed_code_attacks(host_fixtures):
    secret_path, server = host_fixtures
    env = make_env("Python")
    uids = _record_uids(env.sandbox)
    before = set(os.listdir("/tmp"))
    failures = []
    for case in _sandbox_cases(secret_path, server.getsockname()[1]):
        try:
            info = _check_case(case, env)
            assert info["sandbox"]["rlimits"].startswith("cpu=")
        except AssertionError as e:
            failures.append(str(e))
        assert _left_behind(uids) == [], f"{case.id}: sandbox processes left on the host"
    assert not failures, "\n".join(failures)
    _assert_uids_were_dropped(uids)
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody reached the host's loopback
    leaked = {p for p in set(os.listdir("/tmp")) - before if "escape" in p or "pwned" in p}
    assert not leaked and not (Path(__file__).parent / "escape.txt").exists()
    assert not Path("/root/escape.txt").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop needs root")
def test_sandbox_without_namespaces_still_enforces_limits(host_fixtures):
    """The fallback when unshare is unavailable: rlimits, the throw-away uid, a private work dir."""
    from envs.sandbox import Sandbox, SandboxLimits

    secret_path, _ = host_fixtures
    sandbox = Sandbox(SandboxLimits(**FAST_SANDBOX), use_namespaces=False)
    uids = _record_uids(sandbox)
    assert sandbox.protection["namespaces"] == [] and "not isolated" in sandbox.protection["network"]
    cases = [
        ("while True:\n    pass", "CPU time limit|wall-clock timeout"),
        ("x = bytearray(10 * 1024**3)", "MemoryError"),
        (f"print(open({secret_path!r}).read())", "Permission denied"),
        ("print(open('/etc/shadow').read())", "Permission denied"),
        (
            "import subprocess\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\nraise SystemExit(5)",
            "",
        ),
    ]
    for code, fragment in cases:
        result = sandbox.run_python(code)
        text = f"{result.reason} {result.stderr}"
        assert not result.ok and any(w in text for w in fragment.split("|")), (code, text)
        assert SECRET_VALUE not in result.stdout + result.stderr
        assert _left_behind(uids) == [], f"left processes behind: {code!r}"
    _assert_uids_were_dropped(uids)
