"""A decode step's latent MLA attention: ``kernels.mla.latent_decode_triton`` against vLLM's Triton kernel.

The rollout engine's latent form (``rollout.vllm_layers.MLALatentPagedAttention``) at gpu_1b's shape: 8 query
heads over one latent head of 256 + 64 columns in a 320-wide page row, K and V interleaved in each token's row as
vLLM 0.26's Triton backend lays them out, pages in a shuffled order. Three ways, on the same cache:

* ``vllm``: vLLM's ``unified_attention`` as vLLM calls it (V read from the V pages);
* ``vllm_v_from_k``: the same kernel handed the K pages as V (what the engine runs off decode steps:
  ``rollout.vllm_layers.read_values_from_keys``, on unless ``LONGHORIZON_MLA_VALUES_FROM_KEYS=0``);
* ``ours``: ``kernels.mla.latent_decode_triton`` (what it runs for decode-only steps).

Per batch (sequences x context): the largest error of each against the fp32 reference
(``kernels.mla.latent_decode_naive``) on the output's first 256 columns, and each kernel's microseconds a call
inside a replayed CUDA graph (vLLM's engine replays decode steps as graphs), with the cache bytes a call must read
(the K half of each token's row: 640 bytes) over that time. CUDA and vLLM only.

    python3 bench/mla_decode.py [--out DIR]   # DIR/mla_decode.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
import triton
from grouped_mm_decode import graph_us

from kernels.mla import latent_decode_naive, latent_decode_triton
from kernels.mla.triton import TILE, WARPS

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


def one_batch(seqs: int, context: int, block: int, launches: list[tuple[int, int]]) -> dict:
    dev = torch.device("cuda")
    b = paged_batch(seqs, context, block, dev)
    ref = torch.zeros(seqs, H, D, device=dev)
    latent_decode_naive(b["q"].float(), b["k"].float(), ref, b["starts"], b["used"], b["table"], D**-0.5, RANK, ROPE)
    names = ["vllm", "vllm_v_from_k", *(f"ours_t{t}w{w}" for t, w in launches)]
    outs = {name: torch.zeros(seqs, H, D, device=dev, dtype=torch.bfloat16) for name in names}
    calls = {"vllm": vllm_call(b, outs["vllm"], v_from_k=False),
             "vllm_v_from_k": vllm_call(b, outs["vllm_v_from_k"], v_from_k=True)}  # fmt: skip
    for t, w in launches:
        out = outs[f"ours_t{t}w{w}"]
        calls[f"ours_t{t}w{w}"] = functools.partial(
            latent_decode_triton, b["q"], b["k"], out, b["starts"], b["used"], b["table"], D**-0.5, RANK, ROPE,
            tile=t, warps=w,
        )  # fmt: skip
    row = dict(seqs=seqs, context=context, block=block, tokens=int(b["used"].sum()))
    gb = row["tokens"] * (RANK + ROPE) * 2 / 1e9
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        row[f"{name}_max_err"] = (outs[name][..., :RANK].float() - ref[..., :RANK]).abs().max().item()
        us = graph_us(fn)
        row[f"{name}_us"], row[f"{name}_tb_s"] = us, gb / us * 1e3
    row["ours"] = f"ours_t{launches[0][0]}w{launches[0][1]}"  # the default launch shape comes first
    row["ours_vs_vllm"] = row["vllm_us"] / row[f"{row['ours']}_us"]
    row["best"] = min(calls, key=lambda name: row[f"{name}_us"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/mla_decode")))
    p.add_argument("--batches", default="8x2048,64x1024,64x3584,128x3584,64x8192",
                   help="sequences x mean context, comma-separated")  # fmt: skip
    p.add_argument("--block", type=int, default=16, help="tokens a page (the engine's attention block size)")
    p.add_argument("--launches", default=f"{TILE}x{WARPS},16x4,64x4,64x8,32x8",
                   help="our kernel's tile x warps to time, comma-separated (the first is the one compared)")  # fmt: skip
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_decode: needs a CUDA GPU and vLLM (its Triton attention kernel is the baseline)")
    torch.manual_seed(0)
    launches = [tuple(int(x) for x in spec.split("x")) for spec in args.launches.split(",")]
    rows = []
    for spec in args.batches.split(","):
        seqs, context = (int(x) for x in spec.split("x"))
        rows.append(one_batch(seqs, context, args.block, launches))
        r = rows[-1]
        ours = r["ours"]
        times = ", ".join(f"{key[:-3]} {value:.1f}" for key, value in r.items() if key.endswith("_us"))
        print(f"{seqs} x {context} (block {args.block}): {ours} {r[ours + '_us']:.1f} us ({r[ours + '_tb_s']:.2f} TB/s)"
              f" -> {r['ours_vs_vllm']:.2f}x vllm; best {r['best']}; us: {times}; max err vllm "
              f"{r['vllm_max_err']:.2e}, {ours} {r[ours + '_max_err']:.2e}", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    (args.out / "mla_decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
