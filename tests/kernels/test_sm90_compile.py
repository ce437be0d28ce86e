"""The Triton kernels this repository launches on CUDA compile for an H200 (sm90) on this CPU machine:
``triton.compile`` to PTX and a cubin with the ptxas Triton ships, no GPU needed. The interpreter tests
check what the kernels compute; this one catches what only the GPU compiler refuses (a construct the
interpreter accepts), before a device run or a user's GPU finds it."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _import_for_gpu(name: str, *deps: str):
    """``name`` imported afresh without TRITON_INTERPRET (its kernels JIT functions, not interpreted ones), with
    ``deps`` (modules whose jitted helpers its kernels call) imported afresh first; afterwards sys.modules holds
    what it held before, so no other test picks these copies up."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    saved = {m: sys.modules.pop(m, None) for m in (*deps, name)}
    try:
        for dep in deps:
            importlib.import_module(dep)
        return importlib.import_module(name)
    finally:
        for m, module in saved.items():  # the package's attribute too: the import bound the fresh copy there
            sys.modules.pop(m, None)
            parent, _, child = m.rpartition(".")
            if module is not None:
                sys.modules[m] = module
                setattr(sys.modules[parent], child, module)
            elif parent in sys.modules:  # not imported before: a later import makes its own (interpreted) copy
                vars(sys.modules[parent]).pop(child, None)
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


def _kernels():
    conv = _import_for_gpu("kernels.conv.triton")
    moe = _import_for_gpu("kernels.moe.triton", "kernels.glu.jit")
    decode = _import_for_gpu("kernels.kda.triton.decode", "kernels.kda.triton.common")
    attnres = _import_for_gpu("kernels.attnres.triton")

    io = {"x_ptr": "*bf16", "w_ptr": "*fp32", "pos_ptr": "*i32"}
    return [
        # the engine's decode step of a KDA layer's three convs in one launch
        (conv._conv_state_step,
         {**{n: t for i in range(3) for n, t in ((f"x{i}_ptr", "*bf16"), (f"w{i}_ptr", "*fp32"),
                                                  (f"state{i}_ptr", "*bf16"), (f"y{i}_ptr", "*bf16"))},
          "slot_ptr": "*i64", "C": "i32", "sx": "i32", "s0": "i64", "s1": "i32", "s2": "i32", "K": "constexpr",
          "SILU": "constexpr", "BC": "constexpr"},
         {"K": 4, "SILU": True, "BC": 256}),
        # the engine's prefill continuing from the kept sessions' conv states (fp32 states, bf16 inputs)
        (conv._conv_fwd_state,
         {**io, "seq_ptr": "*i32", "state_ptr": "*fp32", "y_ptr": "*bf16", "R": "i32", "C": "i32", "ss0": "i32",
          "ss1": "i32", "ss2": "i32", "K": "constexpr", "SILU": "constexpr", "BR": "constexpr", "BC": "constexpr"},
         {"K": 4, "SILU": True, "BR": 64, "BC": 64}),
        (conv._conv_dpre, {**io, "dy_ptr": "*bf16", "dpre_ptr": "*fp32", "R": "i32", "C": "i32", "K": "constexpr",
                           "BR": "constexpr", "BC": "constexpr"}, {"K": 4, "BR": 64, "BC": 64}),
        (conv._conv_bwd, {**io, "dpre_ptr": "*fp32", "dx_ptr": "*bf16", "dw_ptr": "*fp32", "R": "i32", "C": "i32",
                          "K": "constexpr", "BR": "constexpr", "BC": "constexpr"}, {"K": 4, "BR": 64, "BC": 64}),
        (moe._scale_rows, {"x_ptr": "*bf16", "w_ptr": "*fp32", "R": "i32", "N": "constexpr", "sx": "constexpr",
                           "BR": "constexpr", "BN": "constexpr"}, {"N": 512, "sx": 512, "BR": 8, "BN": 256}),
        # the expert GEMMs: the decode step's one-launch kernel (bf16) and the scheduled one (the fp32 engines')
        (moe._gmm_groups,
         {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offs_ptr": "*i32", "N": "i32", "K": "i32",
          **{s: "i64" for s in ("sxm", "sxk", "swg", "swn", "swk", "sym", "syn")}, "PREC": "constexpr",
          "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
         {"PREC": "tf32", "BM": moe.SMALL_BM, "BN": moe.SMALL_BN, "BK": moe.SMALL_BK}),
        # the engine's decode experts up to the down product: permute, gate/up product and SiTU in one launch
        (moe._situ_gmm_groups,
         {"z_ptr": "*bf16", "src_ptr": "*i64", "w_ptr": "*bf16", "h_ptr": "*bf16", "offs_ptr": "*i32", "T": "i32",
          "I": "i32", "K": "i32", **{s: "i64" for s in ("szt", "szk", "swg", "swn", "swk", "shm")},
          **{n: "fp32" for n in ("beta", "inv_beta", "lb", "inv_lb")}, "PREC": "constexpr", "BM": "constexpr",
          "BN": "constexpr", "BK": "constexpr"},
         {"PREC": "tf32", "BM": moe.SMALL_BM, "BN": moe.SMALL_BN // 2, "BK": moe.SMALL_BK}),
        # the engine's decode route layout in two launches
        (moe._route_ranks, {"experts_ptr": "*i64", "rank_ptr": "*i64", "counts_ptr": "*i32", "S": "i32",
                            "BS": "constexpr"}, {"BS": 128}),
        (moe._route_rows,
         {"experts_ptr": "*i64", "src_row_ptr": "*i64", "row_of_slot_ptr": "*i64", "offs_ptr": "*i32",
          "counts_ptr": "*i32", "start_ptr": "*i32", **{n: "i32" for n in ("S", "T", "k", "P", "align", "E")},
          "BE": "constexpr", "BS": "constexpr", "BP": "constexpr"},
         {"BE": 128, "BS": 128, "BP": 1024}),
        # a prefill step's route layout in three launches (the engine's default prefill routing): ranks in 1,024-slot
        # blocks, then the groups in one program (a tail loop from a computed start), then the slots' rows
        (moe._route_ranks, {"experts_ptr": "*i64", "rank_ptr": "*i64", "counts_ptr": "*i32", "S": "i32",
                            "BS": "constexpr"}, {"BS": 1024}),
        (moe._route_starts,
         {"src_row_ptr": "*i64", "offs_ptr": "*i32", "counts_ptr": "*i32", "start_ptr": "*i32",
          **{n: "i32" for n in ("T", "P", "align", "E")}, "BE": "constexpr", "BP": "constexpr"},
         {"BE": 128, "BP": 1024}),
        (moe._route_place,
         {"experts_ptr": "*i64", "src_row_ptr": "*i64", "row_of_slot_ptr": "*i64", "start_ptr": "*i32", "S": "i32",
          "k": "i32", "BS": "constexpr"}, {"BS": 1024}),
        # the engine's decode expert selection from the router logits, a row a program
        (moe._select_small,
         {"x_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i64", "w_ptr": "*fp32", "E": "i32", "sx": "i32",
          "scaling": "fp32", "N": "constexpr", "NP": "constexpr", "BE": "constexpr", "RENORM": "constexpr"},
         {"N": 8, "NP": 8, "BE": 128, "RENORM": True}),
        # the engine's decode top-k, a row a program
        (moe._top_small, {"x_ptr": "*fp32", "vals_ptr": "*fp32", "idx_ptr": "*i64", "E": "i32", "sx": "i32",
                          "N": "constexpr", "BE": "constexpr"}, {"N": 8, "BE": 128}),
        (moe._gmm_rows,
         {"x_ptr": "*fp32", "w_ptr": "*fp32", "y_ptr": "*fp32", "offs_ptr": "*i32", "tile_group_ptr": "*i32",
          "tile_row_ptr": "*i32", "N": "i32", "K": "i32", "G": "i32",
          **{s: "i64" for s in ("sxm", "sxk", "swg", "swn", "swk", "sym", "syn")}, "PREC": "constexpr",
          "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
         {"PREC": "ieee", "BM": moe.BM, "BN": moe.BN, "BK": moe.BK}),
        # the engine's AttnRes mix and the sub-layer's norm after it: bf16 sources, fp32 weights
        (attnres._mix_norm_row,
         {"v_ptr": "*bf16", **{n: "*fp32" for n in ("q_ptr", "kw_ptr", "ow_ptr")}, "y_ptr": "*bf16", "S": "i32",
          "D": "i32", "sv_s": "i64", "sv_n": "i32", "sy_n": "i32", "eps": "fp32", "out_eps": "fp32",
          "BD": "constexpr"},
         {"BD": 1024}),
        # the engine's decode step: vLLM's int32 slot ids read as they are, token rows from n * T
        (decode._decode_kernel,
         {**{n: "*fp32" for n in ("q", "k", "v", "g", "beta")}, "o": "*fp32", "h_in": "*fp32", "h_out": "*fp32",
          "state_indices": "*i32", "cu_seqlens": "*fp32", "scale": "fp32", "stride_slot": "i64", "T": "i32",
          "H": "i32", "K": "i32", "V": "i32", "BK": "constexpr", "BV": "constexpr", "HAS_H0": "constexpr",
          "HAS_IDX": "constexpr", "STORE_HT": "constexpr", "VARLEN": "constexpr"},
         {"BK": 128, "BV": 32, "HAS_H0": True, "HAS_IDX": True, "STORE_HT": True, "VARLEN": False}),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(17))
def test_kernel_compiles_for_sm90(index):
    fn, signature, constexprs = _kernels()[index]
    # keyword order is the kernel's own: the signature must name every parameter
    assert list(signature) == fn.arg_names, (list(signature), fn.arg_names)
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))  # fmt: skip
    except FileNotFoundError as e:  # a Triton wheel without its CUDA tools: nothing to compile with
        pytest.skip(f"no ptxas: {e}")
    assert ".entry" in compiled.asm["ptx"] and compiled.asm.get("cubin")
