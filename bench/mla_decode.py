"""A decode step's latent MLA attention: ``kernels.mla.latent_decode_triton`` against vLLM's Triton kernel.

The rollout engine's latent form (``rollout.vllm_layers.MLALatentPagedAttention``) at gpu_1b's shape: 8 query
heads over one latent head of 256 + 64 columns in a 320-wide page row, K and V interleaved in each token's row as
vLLM 0.26's Triton backend lays them out, pages in a shuffled order. Three ways, on the same cache:

* ``vllm``: vLLM's ``unified_attention`` as vLLM calls it (V read from the V pages);
* ``vllm_v_from_k``: the same kernel handed the K pages as V (what the engine runs off decode steps:
  ``rollout.vllm_layers.read_values_from_keys``, on unless ``LONGHORIZON_MLA_VALUES_FROM_KEYS=0``);
* ``ours``: ``kernels.mla.latent_decode_triton`` (what it runs for decode-only steps), at each launch of
  ``--launches`` (tile x warps, optionally x pipeline stages x splits a sequence; the first is the default).

Per batch (sequences x context): the largest error of each against the fp32 reference
(``kernels.mla.latent_decode_naive``) on the output's first 256 columns, and each kernel's microseconds a call
inside a replayed CUDA graph (vLLM's engine replays decode steps as graphs), with the cache bytes a call must read
(the K half of each token's row: 640 bytes) over that time. CUDA only; without vLLM (``--no-vllm``, or vLLM not
importable) our launches only, the first the baseline.

    python3 bench/mla_decode.py [--out DIR]   # DIR/mla_decode.json
    python3 bench/mla_decode.py --no-vllm --launches 32x4,32x4x2,32x4x4,32x4x3x8,32x4x3x32
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from grouped_mm_decode import graph_us

from kernels.mla import latent_decode_naive, latent_decode_triton
from kernels.mla.triton import SPLITS, TILE, WARPS

H, RANK, ROPE, D = 8, 256, 64, 320  # gpu_1b (configs/model/gpu_1b.yaml), rollout.vllm_plugin.latent_head_size


def paged_batch(seqs: int, context: int, block: int, dev: torch.device) -> dict:
    """One decode token per sequence, contexts spread over [context / 2, 3 context / 2], K|V rows interleaved."""
    used = torch.randint(context // 2, 3 * context // 2 + 1, (seqs,), device=dev, dtype=torch.int32)
    pages = (used + block - 1) // block
    blocks = int(pages.sum())
    kv = torch.zeros(blocks, 1, block, 2 * D, device=dev, dtype=torch.bfloat16)
    kv[..., : RANK + ROPE] = torch.randn(blocks, 1, block, RANK + ROPE, device=dev)
    kv[..., D : D + RANK] = kv[..., :RANK]  # V = c_kv
    k_cache, v_cache = kv.transpose(1, 2).split(D, dim=-1)
    order = torch.randperm(blocks, device=dev, dtype=torch.int32)
    table = torch.zeros(seqs, int(pages.max()), device=dev, dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages.tolist()):
        table[i, :n] = order[at : at + n]
        at += n
    q = torch.zeros(seqs, H, D, device=dev, dtype=torch.bfloat16)
    q[..., : RANK + ROPE] = torch.randn(seqs, H, RANK + ROPE, device=dev)
    return dict(q=q, k=k_cache, v=v_cache, used=used, table=table, block=block,
                starts=torch.arange(seqs + 1, device=dev, dtype=torch.int32))  # fmt: skip


def vllm_call(b: dict, out: torch.Tensor, v_from_k: bool):
    """vLLM 0.26's ``unified_attention`` with the arguments its ``TritonAttentionImpl.forward`` passes for this
    layer (its decode path: 3D split-KV below 128 sequences, 16 softmax segments)."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    seqs, dev = b["used"].shape[0], b["q"].device
    segments, threshold = 16, 128
    padded = triton.next_power_of_2(D)
    buf = dict(softmax_segm_output=torch.empty(threshold, H, segments, padded, device=dev),
               softmax_segm_max=torch.empty(threshold, H, segments, device=dev),
               softmax_segm_expsum=torch.empty(threshold, H, segments, device=dev))  # fmt: skip
    scale = torch.ones(seqs, 1, device=dev)
    max_k = int(b["used"].max())
    return lambda: unified_attention(
        q=b["q"], k=b["k"], v=b["k"] if v_from_k else b["v"], out=out, cu_seqlens_q=b["starts"], max_seqlen_q=1,
        seqused_k=b["used"], max_seqlen_k=max_k, softmax_scale=D**-0.5, causal=True, window_size=(-1, -1),
        block_table=b["table"], softcap=0, q_descale=None, k_descale=scale, v_descale=scale,
        seq_threshold_3D=threshold, num_par_softmax_segments=segments, **buf,
    )  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """A launch of our kernel (``latent_decode_triton``'s keywords); spelled TILExWARPS[xSTAGES[xSPLITS]]."""

    tile: int = TILE
    warps: int = WARPS
    stages: int | None = None
    splits: int = SPLITS

    @classmethod
    def parse(cls, spec: str) -> Launch:
        parts = [int(x) for x in spec.split("x")]
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"a launch is TILExWARPS[xSTAGES[xSPLITS]], got {spec!r}")
        return cls(*parts)

    @property
    def name(self) -> str:
        stages = "" if self.stages is None else f"s{self.stages}"
        splits = "" if self.splits == SPLITS else f"p{self.splits}"
        return f"ours_t{self.tile}w{self.warps}{stages}{splits}"


def one_batch(seqs: int, context: int, block: int, launches: list[Launch], with_vllm: bool = True) -> dict:
    dev = torch.device("cuda")
    b = paged_batch(seqs, context, block, dev)
    ref = torch.zeros(seqs, H, D, device=dev)
    latent_decode_naive(b["q"].float(), b["k"].float(), ref, b["starts"], b["used"], b["table"], D**-0.5, RANK, ROPE)
    names = [*(("vllm", "vllm_v_from_k") if with_vllm else ()), *(launch.name for launch in launches)]
    outs = {name: torch.zeros(seqs, H, D, device=dev, dtype=torch.bfloat16) for name in names}
    calls = {name: vllm_call(b, outs[name], v_from_k=name == "vllm_v_from_k") for name in names[: 2 * with_vllm]}
    for launch in launches:
        calls[launch.name] = functools.partial(
            latent_decode_triton, b["q"], b["k"], outs[launch.name], b["starts"], b["used"], b["table"], D**-0.5,
            RANK, ROPE, **asdict(launch),
        )  # fmt: skip
    row = dict(seqs=seqs, context=context, block=block, tokens=int(b["used"].sum()))
    gb = row["tokens"] * (RANK + ROPE) * 2 / 1e9
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        row[f"{name}_max_err"] = (outs[name][..., :RANK].float() - ref[..., :RANK]).abs().max().item()
        us = graph_us(fn)
        row[f"{name}_us"], row[f"{name}_tb_s"] = us, gb / us * 1e3
    row["ours"] = launches[0].name  # the default launch shape comes first
    if with_vllm:
        row["ours_vs_vllm"] = row["vllm_us"] / row[f"{row['ours']}_us"]
    row["best"] = min(calls, key=lambda name: row[f"{name}_us"])
    return row


def summary(r: dict, block: int) -> str:
    ours = r["ours"]
    times = ", ".join(f"{key[:-3]} {value:.1f}" for key, value in r.items() if key.endswith("_us"))
    errs = ", ".join(f"{key[:-8]} {value:.2e}" for key, value in r.items() if key.endswith("_max_err"))
    vs = f" -> {r['ours_vs_vllm']:.2f}x vllm" if "ours_vs_vllm" in r else ""
    return (f"{r['seqs']} x {r['context']} (block {block}): {ours} {r[ours + '_us']:.1f} us "
            f"({r[ours + '_tb_s']:.2f} TB/s){vs}; best {r['best']}; us: {times}; max err: {errs}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/mla_decode")))
    p.add_argument("--batches", default="8x2048,64x1024,64x3584,128x3584,64x8192",
                   help="sequences x mean context, comma-separated")  # fmt: skip
    p.add_argument("--block", type=int, default=1280,
                   help="tokens a page: the engine's attention block size, 1280 for gpu_1b on vLLM 0.26 (it sizes the "
                        "attention page up to the KDA state page; runs before 2026-12-07 used 16)")  # fmt: skip
    p.add_argument("--launches", default=f"{TILE}x{WARPS},16x4,64x4,64x8,32x8",
                   help="our kernel's launches to time, TILExWARPS[xSTAGES[xSPLITS]] comma-separated (the first is "
                        "the one compared)")  # fmt: skip
    p.add_argument("--no-vllm", action="store_true", help="time our launches only (also when vLLM is missing)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_decode: needs a CUDA GPU (and vLLM for its Triton attention kernel as the baseline)")
    with_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
    if not with_vllm:
        print("mla_decode: without vLLM's kernel (--no-vllm or vLLM not installed): our launches only", flush=True)
    torch.manual_seed(0)
    launches = [Launch.parse(spec) for spec in args.launches.split(",")]
    rows = []
    for spec in args.batches.split(","):
        seqs, context = (int(x) for x in spec.split("x"))
        rows.append(one_batch(seqs, context, args.block, launches, with_vllm))
        print(summary(rows[-1], args.block), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    (args.out / "mla_decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
