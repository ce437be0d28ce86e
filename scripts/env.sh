# Environment for running longhorizon on this machine; sourced by the other scripts.
# Caches stay inside the checkout, nothing is fetched from a model hub.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LONGHORIZON_ROOT="$_root"
export PATH="$_root/.venv/bin:$PATH"
export VLLM_CACHE_ROOT="$_root/.cache/vllm"
export XDG_CACHE_HOME="$_root/.cache/xdg"
export HF_HOME="$_root/.cache/hf"
export TORCHINDUCTOR_CACHE_DIR="$_root/.cache/inductor"
export TRITON_CACHE_DIR="$_root/.cache/triton"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export TOKENIZERS_PARALLELISM=false
unset _root
