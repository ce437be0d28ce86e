"""bench/mla_decode.py on the CPU: its paged batch (vLLM's interleaved K|V rows, shuffled pages, contexts spread
around the mean) is one the reference and the Triton kernel (interpreted) agree on at gpu_1b's head shape, and
without a GPU the script says so instead of timing anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernels.testing import assert_close, import_interpreted

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "mla_decode.py"
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(ROOT / "bench"))  # the bench imports its sibling grouped_mm_decode
    yield
    sys.path.remove(str(ROOT / "bench"))


def test_the_bench_batch_is_the_engine_layout_and_the_kernel_agrees(bench_path, bench):
    (mla,) = import_interpreted("kernels.mla.triton")
    torch.manual_seed(0)
    b = bench.paged_batch(3, 40, 16, torch.device("cpu"))
    k = b["k"]
    assert k.shape[2:] == (1, bench.D) and k.stride(1) == 2 * bench.D  # each token's row holds K then V
    assert torch.equal(b["v"][..., : bench.RANK], k[..., : bench.RANK])  # V = c_kv
    assert int(b["used"].min()) >= 20 and int(b["used"].max()) <= 60
    ref = torch.zeros(3, bench.H, bench.D)
    bench.latent_decode_naive(b["q"].float(), k.float(), ref, b["starts"], b["used"], b["table"], 0.05, bench.RANK,
                              bench.ROPE)  # fmt: skip
    out = torch.zeros(3, bench.H, bench.D, dtype=torch.bfloat16)
    mla.latent_decode_triton(b["q"], k, out, b["starts"], b["used"], b["table"], 0.05, bench.RANK, bench.ROPE)
    assert_close("out", ref, out.float(), 1e-2)


def test_launch_specs_parse_and_name_themselves(bench_path, bench):
    assert bench.Launch.parse("32x4") == bench.Launch(32, 4)
    assert bench.Launch.parse("32x4x2x8") == bench.Launch(32, 4, 2, 8)
    assert bench.Launch.parse("32x4").name == "ours_t32w4"
    assert bench.Launch.parse("64x8x3x32").name == "ours_t64w8s3p32"
    with pytest.raises(ValueError, match="TILExWARPS"):
        bench.Launch.parse("32")


def test_without_a_gpu_it_says_so(bench_path, bench, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["mla_decode.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main()
