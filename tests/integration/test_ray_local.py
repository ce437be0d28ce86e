"""scripts/quickstart.sh stops only the Ray cluster it started (scripts/ray_local.sh), never every Ray
cluster of the machine as ``ray stop`` does: another cluster, started here with its own temp dir and
ports as another user's or another run's would be, still runs after the quickstart's cleanup."""

import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")  # the CLI of this environment's Ray
_spec = importlib.util.spec_from_file_location("ray_local", ROOT / "scripts" / "ray_local.py")
ray_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ray_local)


def sleeper(*args: str, child: bool = False) -> subprocess.Popen:
    """A process whose command line holds ``args``; with ``child``, it starts a child that does not."""
    code = "import subprocess, sys, time\n"
    if child:
        code += "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    return subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)", *args])


def test_stop_ends_the_processes_naming_the_temp_dir_and_their_children_only():
    head = sleeper("--temp-dir=/tmp/lh_fake.ab", child=True)
    inside = sleeper("--session-dir=/tmp/lh_fake.ab/session_1")
    other = sleeper("--temp-dir=/tmp/lh_fake.abc")  # a name that merely starts the same
    try:
        time.sleep(1.0)  # the child is started
        kid = psutil.Process(head.pid).children()[0]
        found = {p.pid for p in ray_local.cluster_processes("/tmp/lh_fake.ab")}
        assert found == {head.pid, inside.pid, kid.pid}
        assert ray_local.stop("/tmp/lh_fake.ab", grace=5) == 3
        assert head.wait(5) is not None and inside.wait(5) is not None and not kid.is_running()
        assert other.poll() is None
    finally:
        for p in (head, inside, other):
            p.kill()
            p.wait()


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first ``server.fails`` requests, then 200 (a dashboard agent starting up); with
    ``server.token`` set, 401 to a request without that bearer token (a dashboard under token auth)."""

    def do_GET(self):
        self.server.seen += 1
        if self.server.token and self.headers.get("authorization") != f"Bearer {self.server.token}":
            self.send_response(401)  # a dashboard under token auth
        else:
            self.send_response(503 if self.server.seen <= self.server.fails else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Flaky)
    server.seen, server.fails, server.token = 0, 3, None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_ready_waits_until_every_url_answers(flaky):
    url = f"http://127.0.0.1:{flaky.server_port}/api/healthz"
    ray_local.wait_ready([url, url], timeout=30, interval=0.01)
    assert flaky.seen == 5  # three 503s, then one 200 for each URL


def test_ready_names_the_url_that_never_answered(flaky, capsys):
    flaky.fails = 10**9
    (closed,) = ray_local.free_ports(1)  # nothing listens there
    up = f"http://127.0.0.1:{flaky.server_port}/api/healthz"
    with pytest.raises(TimeoutError, match=f"{up} did not answer within 0.3 s .last: HTTP 503"):
        ray_local.wait_ready([up], timeout=0.3, interval=0.01)
    assert ray_local.main(["ready", f"http://127.0.0.1:{closed}/api/version", "--timeout", "0.3"]) == 1
    err = capsys.readouterr().err
    assert f"not ready: http://127.0.0.1:{closed}/api/version did not answer" in err and "refused" in err


@pytest.mark.parametrize("sent", ["right", "wrong"])
def test_ready_sends_the_token_under_token_auth(flaky, sent):
    """As `ray job submit` does: the probes carry RAY_AUTH_TOKEN when RAY_AUTH_MODE=token (Ray's own loader, in a
    process of its own as the script runs: the loader caches its token per process)."""
    flaky.token, flaky.fails = uuid.uuid4().hex, 0
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": flaky.token if sent == "right" else "0" * 32,
    }
    url = f"http://127.0.0.1:{flaky.server_port}/api/version"
    cmd = [sys.executable, str(ROOT / "scripts" / "ray_local.py"), "ready", url, "--timeout", "1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if sent == "right":
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode == 1 and "HTTP 401 (token auth: no token or a wrong one)" in out.stderr, (
            out.stderr
        )


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = ray_local.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.fixture
def other_cluster():
    """A Ray cluster that is not the quickstart's: its own temp dir and ports, no dashboard."""
    temp = tempfile.mkdtemp(prefix="lh_other.", dir="/tmp")  # short: Ray's socket paths live inside it
    gcs, client, agent = ray_local.free_ports(3)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    cmd = [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=1",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
           "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats",
           "--object-store-memory=100000000"]  # fmt: skip
    try:
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
        yield temp, f"127.0.0.1:{gcs}", env
    finally:
        ray_local.stop(temp)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_quickstart_cleanup_leaves_another_cluster_running(other_cluster):
    temp, gcs, env = other_cluster
    theirs = ray_local.cluster_processes(temp)
    assert any(p.name() == "gcs_server" for p in theirs) and any(p.name() == "raylet" for p in theirs)
    # the cheap path through the whole script: its own cluster starts, the job is submitted and fails
    # at once on a config error, the script exits non-zero through its cleanup
    out = subprocess.run(["bash", "scripts/quickstart.sh", "learner.lrr=1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode != 0 and "learner.lrr" in log, log[-3000:]
    m = re.search(r"ray cluster: temp dir (\S+), GCS (\S+), dashboard (\S+)", out.stdout)
    assert m, out.stdout[-3000:]
    own_dir, own_gcs = m.group(1), m.group(2)
    assert own_gcs != gcs and own_dir != temp
    assert ray_local.cluster_processes(own_dir) == [] and not Path(own_dir).exists()  # its own: gone
    assert all(p.is_running() for p in theirs), [p for p in theirs if not p.is_running()]  # the other: not
    status = subprocess.run([RAY, "status", "--address", gcs], env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert status.returncode == 0 and "Active:" in status.stdout, status.stdout + status.stderr


@pytest.mark.ray
@pytest.mark.slow
def test_a_job_is_taken_at_once_under_token_auth():
    """ray_local_start under token auth (a test process's own ``ray.init()`` sets RAY_AUTH_MODE=token in its
    environment, and a fixture's cluster inherits it): the readiness probes carry the token as `ray job submit`
    does, and a job submitted right after the start runs (no "No available agent to submit job")."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex, "RAY_ADDRESS": ""}
    env.pop("PYTHONPATH", None)
    script = "source scripts/env.sh && source scripts/ray_local.sh && ray_local_start --num-cpus=1 " \
             "--object-store-memory=100000000 && ray job submit --address $RAY_LOCAL_DASHBOARD -- " \
             "python -c 'print(6 * 7)'; rc=$?; ray_local_stop; exit $rc"  # fmt: skip
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "42" in log and "succeeded" in log, log[-3000:]
