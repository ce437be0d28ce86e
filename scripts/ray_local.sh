# A local Ray cluster of one's own, beside any other Ray cluster of the machine; sourced by
# scripts/quickstart.sh (and usable from a shell):
#
#   source scripts/ray_local.sh
#   ray_local_start --num-cpus=2        # extra arguments go to `ray start --head`
#   ray job submit --address "$RAY_LOCAL_DASHBOARD" -- python -m rl.train --config ...
#   ray_local_stop                      # this cluster only
#
# The cluster gets its own temp dir (LH_RAY_TEMP_DIR, else a new /tmp/lh_ray.XXXXXX: short, as Ray's
# socket paths inside it must stay under 108 bytes) and free ports for everything that would otherwise
# take a fixed default (GCS 6379, dashboard 8265, client server 10001, dashboard agent 52365; the
# others Ray picks at random). LH_GCS_PORT and LH_DASHBOARD_PORT pin those two. It listens on loopback
# only. ray_local_start returns once the dashboard and its job agent answer (LH_RAY_READY_TIMEOUT, 120 s).
# `ray stop` would end every Ray cluster of the machine (it has no per-cluster option):
# ray_local_stop ends the processes that name this cluster's temp dir, and their descendants
# (scripts/ray_local.py), then removes the temp dir if ray_local_start made it.
# After ray_local_start: RAY_LOCAL_DIR, RAY_LOCAL_GCS (host:port, for `ray status --address` or
# RAY_ADDRESS) and RAY_LOCAL_DASHBOARD (http://host:port, for `ray job submit --address`).

_RAY_LOCAL_PY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ray_local.py"

ray_local_start() {
    # the cluster listens on loopback only; Ray 2.5x's token auth would make `ray job submit` need a token
    export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
    if [[ -n "${LH_RAY_TEMP_DIR:-}" ]]; then
        RAY_LOCAL_DIR="$LH_RAY_TEMP_DIR"; RAY_LOCAL_OWN_DIR=0; mkdir -p "$RAY_LOCAL_DIR"
    else
        RAY_LOCAL_DIR="$(mktemp -d /tmp/lh_ray.XXXXXX)"; RAY_LOCAL_OWN_DIR=1
    fi
    export RAY_LOCAL_DIR RAY_LOCAL_OWN_DIR
    local gcs dash client agent
    read -r gcs dash client agent < <(python "$_RAY_LOCAL_PY" ports 4)
    gcs="${LH_GCS_PORT:-$gcs}"; dash="${LH_DASHBOARD_PORT:-$dash}"
    if ! ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --port="$gcs" \
            --dashboard-port="$dash" --ray-client-server-port="$client" \
            --dashboard-agent-listen-port="$agent" --temp-dir="$RAY_LOCAL_DIR" --disable-usage-stats \
            "$@" >"$RAY_LOCAL_DIR/ray_start.log" 2>&1; then
        echo "ray start failed; its output:" >&2; cat "$RAY_LOCAL_DIR/ray_start.log" >&2
        ray_local_stop; return 1
    fi
    export RAY_LOCAL_GCS="127.0.0.1:$gcs" RAY_LOCAL_DASHBOARD="http://127.0.0.1:$dash"
    # ray start returns before the dashboard agent that takes jobs is up (ray_local.py's docstring)
    if ! python "$_RAY_LOCAL_PY" ready "$RAY_LOCAL_DASHBOARD/api/version" \
            "http://127.0.0.1:$agent/api/healthz" --timeout "${LH_RAY_READY_TIMEOUT:-120}"; then
        local logs; logs="$(mktemp -d /tmp/lh_ray_logs.XXXXXX)"
        cp -r "$RAY_LOCAL_DIR/session_latest/logs/." "$logs/" 2>/dev/null || true
        echo "its logs (dashboard*.log, dashboard_agent*.log): $logs" >&2
        ray_local_stop; return 1
    fi
    echo "ray cluster: temp dir $RAY_LOCAL_DIR, GCS $RAY_LOCAL_GCS, dashboard $RAY_LOCAL_DASHBOARD"
}

ray_local_stop() {
    [[ -n "${RAY_LOCAL_DIR:-}" ]] || return 0
    python "$_RAY_LOCAL_PY" stop "$RAY_LOCAL_DIR" 2>/dev/null || true
    if [[ "${RAY_LOCAL_OWN_DIR:-0}" == 1 ]]; then rm -rf "$RAY_LOCAL_DIR"; fi
    unset RAY_LOCAL_DIR RAY_LOCAL_OWN_DIR RAY_LOCAL_GCS RAY_LOCAL_DASHBOARD
}
