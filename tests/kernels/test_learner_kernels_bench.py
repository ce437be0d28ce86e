"""bench/learner_kernels.py on the CPU (the tiny preset, kernels interpreted): the shapes come from the model's
own forward, every launch variant is checked against the PyTorch reference before it is timed, a wrong variant
is refused and never named the fastest, and the report gives the default's and the fastest's step time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "learner_kernels.py"
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_shapes_checks_and_the_fastest_passing_launch(bench, monkeypatch, tmp_path):
    import kernels.conv.triton as conv

    real = conv.conv_rows_bwd

    def wrong_when_fused(x, w, pos, dy, silu, kernel, launch=conv.BWD_LAUNCH):
        dx, dw = real(x, w, pos, dy, silu, kernel, launch)
        return (1.5 * dx if kernel == "fused" else dx), dw

    monkeypatch.setattr(conv, "conv_rows_bwd", wrong_when_fused)
    monkeypatch.setattr(sys, "argv", ["learner_kernels.py", "--small", "--quick", "--out", str(tmp_path)])
    assert bench.main() == 0  # a wrong A/B variant is reported, not a failed run; a wrong default would be
    report = json.loads((tmp_path / "learner_kernels.json").read_text())
    rows = report["rows"]
    mixes = {r["shape"] for r in rows if r["op"] == "attn_res"}
    assert mixes and all(s.startswith("S=") for s in mixes)  # the tiny preset's mix + norm nodes, S >= 2
    (conv_shape,) = {r["shape"] for r in rows if r["op"] == "conv"}
    assert conv_shape.startswith("R=64 ") and "K=4" in conv_shape and "silu=True" in conv_shape
    assert all(r["calls"] > 0 for r in rows)
    fused = [r for r in rows if r.get("kernel") == "fused"]
    assert fused and not any(r["ok"] for r in fused) and not any("us" in r for r in fused)
    others = [r for r in rows if r.get("kernel") != "fused"]
    assert all(r["ok"] and r["us"] > 0 and r["error"] <= r["tolerance"] for r in others)
    summary = report["summary"]
    assert set(summary) == {"attn_res forward", "attn_res backward", "conv forward", "conv backward", "adamw step"}
    steps = [r for r in rows if r["op"] == "adamw"]  # the flat buffer's step is the per-tensor step, bit for bit
    assert {r["kernel"] for r in steps} == {"per_tensor", "flat"} and all(r["error"] == 0.0 for r in steps)
    assert steps[0]["params"] > 1e6 and steps[0]["tensors"] > 50 and steps[1]["tensors"] == 1
    assert summary["conv backward"]["best"]["kernel"] in {"two_pass", "two_pass_bf16"}  # never the wrong "fused"
    assert "| conv backward |" in (tmp_path / "learner_kernels.md").read_text()


def test_a_wrong_default_fails_the_run(bench, monkeypatch, tmp_path):
    import kernels.conv.triton as conv

    real = conv.conv_rows_fwd
    monkeypatch.setattr(conv, "conv_rows_fwd", lambda *a, **k: 2 * real(*a, **k))
    argv = ["learner_kernels.py", "--small", "--quick", "--ops", "conv", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 1


def test_an_unknown_kernel_is_named(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["learner_kernels.py", "--small", "--ops", "conv,mla", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--ops: any of attn_res, conv, adamw" in capsys.readouterr().err


def test_shapes_are_captured_on_the_learners_planned_path_too(bench):
    """On CUDA the learner's KDA layers take the planned path (``kda_planned_forward``: the convs through
    ``ShortConvolution.conv_positions``, not the module call); under the interpreter with the Triton conv the CPU
    takes it too: every conv is counted once either way, and the method is put back."""
    import torch
    from learner_mfu import load_arch  # the bench put bench/ on the path

    from model.fast import use_fast_paths
    from model.layers import ShortConvolution

    arch = load_arch(bench.ROOT / "configs/model/cpu_tiny.yaml")
    real = ShortConvolution.conv_positions
    reference = bench.capture_shapes(arch, 64, torch.device("cpu"))
    with use_fast_paths("auto", conv="triton"):
        planned = bench.capture_shapes(arch, 64, torch.device("cpu"))
    assert ShortConvolution.conv_positions is real
    assert planned["conv"] == reference["conv"] and sum(planned["conv"].values()) == 9  # q, k, v of 3 KDA layers
    assert planned["attn_res"] == reference["attn_res"]
