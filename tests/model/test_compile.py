"""Regional torch.compile (model/compile.py): same outputs and gradients, one graph per call signature
and not per module (the count does not grow with the layers or the micro-batch size), and a failing
compiler falls back to eager with one warning instead of stopping the forward. The aot_eager backend
stands in for inductor (same graph capture and autograd split, no C++ build on the 2-core box)."""

from __future__ import annotations

import logging

import pytest
import torch
from model_cases import tiny_config

from model.compile import compile_regions, resolve_compile_scope
from model.fast import use_fast_paths
from model.layers import RMSNorm
from model.modeling import HybridForCausalLM


def _small_model(**overrides):
    torch._dynamo.reset()  # compiled code of an earlier test (another backend) must not be reused
    torch.manual_seed(0)
    return HybridForCausalLM(
        tiny_config(**{"num_hidden_layers": 2, "routed_expert_hidden_size": 32, **overrides})
    )


class CountingBackend:
    """A dynamo backend that counts the graphs it is given and runs them as captured."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


class LimitWarnings(logging.Handler):
    """dynamo's "hit config.recompile_limit" warnings (its loggers do not propagate to caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        if "recompile_limit" in record.getMessage():
            self.messages.append(record.getMessage())


def _step(model, ids):
    out = model(ids, target_ids=ids.roll(-1, 1), return_logits=False)
    loss = out.token_logprobs.sum()
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


def test_compiled_regions_give_the_eager_results():
    model = _small_model().train()
    ids = torch.randint(0, 128, (2, 24))
    loss_ref, grads_ref = _step(model, ids)
    regions = compile_regions(model, backend="aot_eager")
    assert sorted(r.name for r in regions) == [
        "attn_res_mix", "attn_res_mix_norm", "attn_res_mix_norm_grads", "chunk_logits_grad", "chunk_stats",
        "glu_activation", "kda_gates", "kda_output_gate", "l2_normalize_qk", "rms_norm", "route_tensors",
        "routing_weights",
    ]  # fmt: skip
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) > 5 and all(m.norm_fn is norms[0].norm_fn for m in norms)  # one wrapper for all
    loss, grads = _step(model, ids)
    assert all(r.failed is None for r in regions)
    torch.testing.assert_close(loss, loss_ref)
    for a, b in zip(grads_ref, grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _graphs_of_steps(layers: int, lengths_per_step: list[list[int]]) -> tuple[int, list[str]]:
    """Graphs a counting backend compiles over packed train steps of a ``layers``-layer model (AttnRes
    blocks of layers / 2: the same mixes, 2 and 3 sources, whatever the depth), checked against eager."""
    model = _small_model(num_hidden_layers=layers, attn_res_block_size=layers // 2).train()
    backend = CountingBackend()
    eager = {}
    for n, lengths in enumerate(lengths_per_step):
        eager[n] = _packed_step(model, lengths)
    regions = compile_regions(model, backend=backend)
    warnings = LimitWarnings()
    logging.getLogger("torch._dynamo").addHandler(warnings)
    try:
        for n, lengths in enumerate(lengths_per_step):
            loss, grads = _packed_step(model, lengths)
            torch.testing.assert_close(loss, eager[n][0], rtol=1e-6, atol=1e-6)
            for a, b in zip(eager[n][1], grads):
                if a is not None:
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(warnings)
    assert sum(r.graphs() for r in regions) == backend.graphs  # the bench reports graphs() per region
    return backend.graphs, warnings.messages


def _packed_step(model, lengths):
    torch.manual_seed(1)
    T = sum(lengths)
    ids = torch.randint(0, 128, (1, T))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = model(ids, cu_seqlens=cu, target_ids=ids.roll(-1, 1), return_logits=False)
    loss = out.token_logprobs.sum()
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


def test_graph_count_does_not_grow_with_layers_or_micro_batch_size():
    """4 and 12 layers (13 vs 37 norms, 9 vs 25 mixes, 4 vs 12 FFNs) compile the same few graphs, varlen
    micro-batches of 144, 209 and 445 tokens reuse them (token dims dynamic), and dynamo never reaches
    its recompile limit; forward and backward equal eager (fp32: rtol 1e-6 on the loss, 1e-5 on grads)."""
    steps = [[1, 15, 64, 64], [15, 64, 65, 65], [1, 15, 64, 65, 300]]
    graphs_4, warned_4 = _graphs_of_steps(4, steps[:1])
    graphs_12, warned_12 = _graphs_of_steps(12, steps)
    assert warned_4 == warned_12 == []
    assert graphs_12 == graphs_4
    # norms (hidden, latent, kv rank), mixes of 2 and 3, the GLU, routing weights, route layout, and the KDA
    # layer's gates, q/k norms and gated output
    assert 8 <= graphs_4 <= 20


def test_a_failing_compiler_falls_back_to_eager(caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model = _small_model().train()
    ids = torch.randint(0, 128, (1, 12))
    loss_ref, grads_ref = _step(model, ids)
    regions = compile_regions(model, backend=broken_backend)
    with caplog.at_level(logging.WARNING, logger="model.compile"):
        loss, grads = _step(model, ids)  # forward and backward: every region is called
    torch.testing.assert_close(loss, loss_ref)
    for a, b in zip(grads_ref, grads):
        if a is not None:
            torch.testing.assert_close(b, a)
    # a train step calls every region but the lone mix: its mixes run with their norms (attn_res_mix_norm, and
    # attn_res_mix_norm_grads in backward)
    called = [r for r in regions if r.name != "attn_res_mix"]
    assert len(regions) == 12 and all(r.failed and "no compiler here" in r.failed for r in called)
    assert sum("running it eagerly" in r.message for r in caplog.records) == len(called)  # one per function


@pytest.mark.slow
def test_inductor_regions_give_the_eager_results(tmp_path, monkeypatch):
    """The real backend (inductor, C++ on the CPU) through the recompute fast paths: compiled forward
    and backward equal eager within fp32 rounding (inductor fuses and reorders the element-wise ops).
    Slow: the C++ builds took 11 minutes on the loaded 2-core box (passed)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = _small_model().train()
    ids = torch.randint(0, 128, (1, 20))
    loss_ref, grads_ref = _step(model, ids)
    regions = compile_regions(model, backend="inductor")
    loss, grads = _step(model, ids)
    assert all(r.failed is None for r in regions), [r.failed for r in regions if r.failed]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_ref, grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_moe_scope_compiles_one_block_graph_for_every_moe_layer():
    """Scope "moe": each MoE block's whole forward is one compiled function shared by all MoE layers (its
    router, routing and GLU regions traced inside it, not compiled apart), dynamo holds one entry for it
    however many MoE layers run, and forward and backward under bf16 autocast (the learner's GPU dtype;
    the grouped GEMM's meta kernel takes bf16 only) equal eager's."""
    from model.moe import sparse_moe_forward

    model = _small_model(num_hidden_layers=4).train()
    moes = [m for m in model.modules() if type(m).__name__ == "SparseMoE"]
    params = [p for m in moes for p in m.parameters()]

    def step(T: int):  # every MoE block on its own input (the CPU's KDA core has no bf16 path)
        torch.manual_seed(T)
        xs = [torch.randn(1, T, model.config.hidden_size, requires_grad=True) for _ in moes]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sum((m(x)[0].float() * x).sum() for m, x in zip(moes, xs))
        return loss.detach(), torch.autograd.grad(loss, params + xs)

    loss_ref, grads_ref = step(145)
    regions = compile_regions(model, backend="aot_eager", scope="moe")
    step(37)  # another micro-batch size: the token dim is dynamic, no second graph
    loss, grads = step(145)
    with use_fast_paths("moe=loop"):  # the reference loop (per-expert counts on the host) runs eagerly
        loss_loop, _ = step(145)
    by_name = {r.name: r for r in regions}
    block = by_name["sparse_moe_forward"]
    assert len(moes) == 3 and all(m.forward_fn is block for m in moes)
    assert block.failed is None and block.graphs() == 1
    assert "routing_weights" not in by_name and "route_tensors" not in by_name  # traced inside the block
    assert callable(moes[0].gate.weights_fn) and moes[0].gate.weights_fn.__name__ == "routing_weights"
    assert sparse_moe_forward is block.eager
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(loss_loop, loss_ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_ref, grads):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)


def test_moe_scope_with_gradient_is_one_graph_for_every_micro_batch_size():
    """The training MoE block is one graph: its two expert nodes (the GLU combine's activation values and closed-form
    gradient, no autograd inside) trace whole, so dynamo breaks nowhere and the block's compiled backward
    includes theirs; the token dim is dynamic, so other micro-batch sizes compile nothing new, and the reference
    loop path compiles nothing at all."""
    from torch._dynamo.utils import counters

    model = _small_model(num_hidden_layers=3).train()
    moe = next(m for m in model.modules() if type(m).__name__ == "SparseMoE")
    backend = CountingBackend()
    compile_regions(model, backend=backend, scope="moe")
    counters.clear()

    def step(T: int):
        x = torch.randn(1, T, model.config.hidden_size, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            moe(x)[0].float().sum().backward()
        return backend.graphs

    assert step(40) == step(97) == step(211) == step(63) == 1
    assert not counters["graph_break"]
    with use_fast_paths("moe=loop"):
        assert step(50) == 1


def test_unknown_compile_scope_is_named():
    with pytest.raises(ValueError, match="compile scope must be one of"):
        compile_regions(_small_model(), backend="aot_eager", scope="everything")
    with pytest.raises(ValueError, match="compile scope must be auto or one of"):
        resolve_compile_scope("everything", "cpu", on_cuda="blocks")


def test_auto_scope_is_the_gpu_measured_one_on_cuda_and_regions_elsewhere():
    assert resolve_compile_scope("auto", "cpu", on_cuda="blocks") == "regions"
    assert resolve_compile_scope("auto", torch.device("cuda", 0), on_cuda="blocks") == "blocks"
    assert resolve_compile_scope("auto", "cuda", on_cuda="moe") == "moe"
    assert resolve_compile_scope("moe", "cpu", on_cuda="blocks") == "moe"


def test_a_single_token_compiles_every_region_again():
    """Dynamo's 0/1 rule: a token count of 1 is specialised, so a no-grad forward of one token compiles the
    regions over again after any number of longer ones (why the engine captures no CUDA graph of 1:
    ``rollout.worker.capture_sizes``), and a count of 2 after it compiles nothing new."""
    model = _small_model(num_hidden_layers=4).eval()
    backend = CountingBackend()
    compile_regions(model, backend=backend)

    def graphs_after(T: int) -> int:
        with torch.no_grad():
            model(torch.randint(0, model.config.vocab_size, (1, T)))
        return backend.graphs

    longer = [graphs_after(T) for T in (300, 64, 128, 2)]
    assert len(set(longer)) == 1 and longer[0] > 0
    one = graphs_after(1)
    assert one > 1.5 * longer[0]  # most regions again (cpu_tiny with 4 layers: 12 -> 23)
    assert graphs_after(2) == graphs_after(1) == one


def test_compile_record_names_the_region_each_compile_was_for():
    """``compile_record``: every compile of a region is counted under its name (as many as the graphs dynamo
    holds for it, each with its seconds), and a compile of code outside the regions goes elsewhere."""
    from model.compile import OUTSIDE, compile_record

    model = _small_model(num_hidden_layers=4).eval()
    backend = CountingBackend()
    before = compile_record()
    regions = compile_regions(model, backend=backend)
    torch._dynamo.reset()  # drops dynamo's callbacks (an engine's start-up may reset): the regions listen again
    with torch.no_grad():
        for T in (300, 64, 1):  # the 1-token forward compiles most regions again (dynamo's 0/1 rule)
            model(torch.randint(0, model.config.vocab_size, (1, T)))
        torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.ones(3))  # not a region

    def delta(name: str) -> dict:
        old = before.get(name, {"compiles": 0, "seconds": 0.0})
        new = compile_record().get(name, {"compiles": 0, "seconds": 0.0})
        return {"compiles": new["compiles"] - old["compiles"], "seconds": new["seconds"] - old["seconds"]}

    compiled = [r for r in regions if r.graphs()]
    assert len(compiled) >= 5 and any(r.graphs() == 2 for r in compiled)
    for r in compiled:
        assert delta(r.name)["compiles"] == r.graphs() and delta(r.name)["seconds"] > 0, r.name
        each = compile_record()[r.name]["each"]  # one (frame/compile id, seconds) a compile
        assert len(each) == compile_record()[r.name]["compiles"], r.name
        assert all(cid.count("/") == 1 and sec >= 0 for cid, sec in each), each
    # the 1-token forward compiled frames again: a compile id whose second number counts up
    assert any(int(cid.split("/")[1]) > 0 for r in compiled for cid, _ in compile_record()[r.name]["each"])
    assert sum(delta(r.name)["compiles"] for r in regions) == backend.graphs - 1
    assert delta(OUTSIDE)["compiles"] == 1
    assert list(compile_record().values()) == sorted(compile_record().values(), key=lambda v: -v["seconds"])


def test_moe_scope_without_gradient_is_one_graph():
    """The engine's and the no-grad logprob passes' MoE block: no autograd node on the way (the GLU combine
    runs its forward math directly), so the whole block is one graph, with the eager outputs."""
    model = _small_model(num_hidden_layers=3).eval()
    moe = next(m for m in model.modules() if type(m).__name__ == "SparseMoE")
    x = torch.randn(1, 77, model.config.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, e_ref = moe(x)
        backend = CountingBackend()
        (block,) = [r for r in compile_regions(model, backend=backend, scope="moe") if r.name == "sparse_moe_forward"]
        y, e = moe(x)
    assert block.failed is None and backend.graphs == 1
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(y, y_ref)


def test_blocks_scope_compiles_each_kda_layer_whole_without_layout_guards():
    """Scope "blocks": every KDA layer's forward is one compiled function (its short convolutions and kernel
    outside the graph, so the layout of a micro-batch is no guard): micro-batches of other lengths and
    other sequence counts stop adding graphs after the second, and forward and backward equal eager (fp32)."""
    from model.kda import kda_forward

    model = _small_model(num_hidden_layers=3, first_k_dense_replace=3).train()  # dense FFNs: KDA blocks alone
    steps = [[1, 15, 64, 64], [15, 64, 65, 65, 300], [7, 33], [1, 15, 64, 64]]
    eager = [_packed_step(model, lengths) for lengths in steps]
    backend = CountingBackend()
    regions = {r.name: r for r in compile_regions(model, backend=backend, scope="blocks")}
    graphs = []
    for (loss_ref, grads_ref), lengths in zip(eager, steps):
        loss, grads = _packed_step(model, lengths)
        graphs.append(backend.graphs)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(grads_ref, grads):
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    block = regions["kda_forward"]
    assert block.failed is None and block.eager is kda_forward
    assert "kda_gates" not in regions and "l2_normalize_qk" not in regions  # traced inside the block
    assert graphs[1] > graphs[0] > 0 and graphs[3] == graphs[2] == graphs[1]


def test_blocks_scope_gives_moe_and_kda_layers_each_their_own_function():
    """Scope "blocks" on a model with both block kinds: the MoE and KDA layers name their compiled block by the
    same attribute (``forward_fn``), and each must still get its own function (keyed by attribute, every MoE
    layer called the KDA forward). Both compile without a fallback: the MoE blocks under bf16 autocast (the
    CPU's grouped GEMM takes bf16 only), the KDA layers in a whole fp32 step with the MoE's reference loop."""
    from model.kda import kda_forward
    from model.moe import sparse_moe_forward

    model = _small_model(num_hidden_layers=3).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with use_fast_paths("moe=loop"):
        loss_ref, _ = _step(model, ids)
    regions = {r.name: r for r in compile_regions(model, backend="aot_eager", scope="blocks")}
    moes = [m for m in model.modules() if type(m).__name__ == "SparseMoE"]
    kdas = [m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention"]
    assert moes and kdas
    assert all(m.forward_fn.eager is sparse_moe_forward for m in moes)
    assert all(m.forward_fn.eager is kda_forward for m in kdas)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moes[0](torch.randn(1, 40, model.config.hidden_size))
    with use_fast_paths("moe=loop"):
        loss, _ = _step(model, ids)
    assert regions["sparse_moe_forward"].failed is None and regions["kda_forward"].failed is None
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)


def test_served_mixes_compile_one_graph_for_every_number_of_sources(monkeypatch):
    """``prepare_for_serving`` gives every AttnRes mix its sources stacked (``attn_res_mix_stacked``): the mixes
    of 2 to 5 sources of a deep model share one compiled graph (the number of sources a dynamic dim), where
    the learner's mixes (with their norms, ``attn_res_mix_norm``) compile one graph per number; the outputs
    are the learner's, exactly (fp32)."""
    from model.attnres import AttnResMix
    from model.serving import prepare_for_serving

    model = _small_model(num_hidden_layers=8, attn_res_block_size=2).eval()
    ids = torch.randint(0, 128, (1, 37))
    counts = set()
    normed = AttnResMix.normed

    def counting(self, sources, norm, shared=None):
        counts.add(len(sources))
        return normed(self, sources, norm, shared)

    monkeypatch.setattr(AttnResMix, "normed", counting)
    with torch.no_grad():
        ref = model(ids).logits
        learner = CountingBackend()
        (mix,) = [r for r in compile_regions(model, backend=learner) if r.name == "attn_res_mix_norm"]
        model(ids)
        assert len(counts - {1}) >= 3 and mix.graphs() == len(counts - {1})  # one graph per number of sources
        served = _small_model(num_hidden_layers=8, attn_res_block_size=2)
        prepare_for_serving(served, 64)
        backend = CountingBackend()
        regions = {r.name: r for r in compile_regions(served, backend=backend)}
        out = served(ids).logits
    compiled = {n for n, r in regions.items() if r.graphs()}
    assert not {"attn_res_mix", "attn_res_mix_norm"} & compiled  # every mix took the stacked one
    assert regions["attn_res_mix_stacked"].graphs() == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_compiled_regions_run_once_a_step_and_keep_little(monkeypatch):
    """A compiled region is not recomputed through a checkpoint (``model.layers.recompute_region``): each
    RMSNorm module call is one compiled call a train step, its forward and backward in that call's graphs,
    where the checkpoint would call it a second time in backward; gradients equal eager's. What inductor's
    graph keeps for backward: the norm's input tensor itself and per-row statistics, no fp32 copy."""
    from model.compile import CompiledOrEager
    from model.layers import rms_norm

    model = _small_model(num_hidden_layers=4, attn_res_block_size=2).train()
    ids = torch.randint(0, 128, (1, 40))
    loss_ref, grads_ref = _step(model, ids)
    regions = {r.name: r for r in compile_regions(model, backend=CountingBackend())}
    calls = {"region": 0, "module": 0}
    real_call, real_forward = CompiledOrEager.__call__, RMSNorm.forward

    def counting_call(self, *args):
        calls["region"] += self is regions["rms_norm"]
        return real_call(self, *args)

    def counting_forward(self, x):
        calls["module"] += 1
        return real_forward(self, x)

    monkeypatch.setattr(CompiledOrEager, "__call__", counting_call)
    monkeypatch.setattr(RMSNorm, "forward", counting_forward)
    loss, grads = _step(model, ids)
    assert calls["module"] >= 3 and calls["region"] == calls["module"]  # no second call in backward
    torch.testing.assert_close(loss, loss_ref)
    for a, b in zip(grads_ref, grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)

    torch._dynamo.reset()
    compiled = CompiledOrEager(rms_norm, "rms_norm", "inductor")
    x = torch.randn(1, 512, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(64, requires_grad=True) + 0.5
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = compiled(x, w, 1e-5)
    assert compiled.failed is None
    assert x.data_ptr() in {t.data_ptr() for t in kept}  # the input itself
    extra = sum(t.numel() * t.element_size() for t in kept if t.data_ptr() not in (x.data_ptr(), w.data_ptr()))
    assert extra <= 512 * 4  # the rows' rstd in fp32; an fp32 copy of x would be 512 x 64 x 4
    torch.testing.assert_close(out.float(), rms_norm(x, w, 1e-5).float(), rtol=1e-2, atol=1e-2)


def _planned_layer_step(model, attn, lengths: list[int], spec: str, autocast: bool = False) -> list[torch.Tensor]:
    """(output, d input, d every parameter) of the attention layer ``attn`` alone on packed ``lengths`` with the
    fast paths ``spec`` (and CPU bf16 autocast): no state in or out, so a planned path takes it where it can."""
    import contextlib

    from model.layers import seq_layout

    torch.manual_seed(len(lengths))
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, T, model.config.hidden_size, requires_grad=True)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with use_fast_paths(spec), cast:
        y, state = attn(x, seq_layout(1, T, cu, x.device), cu_seqlens=cu)
        assert state is None
        grads = torch.autograd.grad((y.float() * torch.randn(y.shape)).sum(), [x, *attn.parameters()])
    return [y.detach().float(), *grads]


def _check_planned_layer(model, attn, steps, spec: str, reference: str, reference_tol: dict, autocast=False) -> dict:
    """The planned path of ``attn`` (fast paths ``spec``) against the ``reference`` paths on the first layout
    (``reference_tol``), then compiled under scope "blocks": the eager planned path's output and gradients on every
    layout (1e-6), no graph break, no new graph after the second layout (``steps``: four layouts, the last the
    first again). Returns the compiled regions by name."""
    from torch._dynamo.utils import counters

    ref = _planned_layer_step(model, attn, steps[0], reference, autocast)
    eager = [_planned_layer_step(model, attn, lengths, spec, autocast) for lengths in steps]
    for a, b in zip(ref, eager[0]):
        torch.testing.assert_close(b, a, **reference_tol)
    backend = CountingBackend()
    regions = {r.name: r for r in compile_regions(model, backend=backend, scope="blocks")}
    counters.clear()
    graphs = []
    for want, lengths in zip(eager, steps):
        got = _planned_layer_step(model, attn, lengths, spec, autocast)
        graphs.append(backend.graphs)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"]
    assert graphs[1] >= graphs[0] > 0 and graphs[3] == graphs[2] == graphs[1]
    return regions


def test_blocks_scope_compiles_the_planned_kda_layer_as_one_graph(monkeypatch):
    """On the Triton conv and KDA kernels (interpreted here) a KDA layer without state in or out takes the planned
    path: its positions and chunk plan handed over as tensors, its convolutions and kernel custom ops, so scope
    "blocks" compiles the whole layer, dynamo breaks nowhere, other layouts (other lengths and sequence counts)
    stop adding graphs after the second, and the compiled layer gives the eager planned path's output and
    gradients, which agree with the reference path (taps and the CPU's chunked KDA) to fp32 rounding."""
    from kernels.testing import import_interpreted
    from model.kda import KimiDeltaAttention, kda_planned_forward

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import_interpreted(*(f"kernels.kda.triton.{m}" for m in ("common", "launch", "fwd", "bwd", "chunk")),
                       "kernels.conv.triton")  # fmt: skip
    model = _small_model(num_hidden_layers=2).train()
    attn = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    # the reference path: taps, the CPU's chunked KDA
    regions = _check_planned_layer(model, attn, [[1, 15, 65], [15, 3], [7, 33], [1, 15, 65]], "conv=triton",
                                   "conv=torch", {"rtol": 2e-4, "atol": 2e-5})  # fmt: skip
    planned = regions["kda_planned_forward"]
    assert planned.failed is None and planned.eager is kda_planned_forward and attn.planned_fn is planned
    assert regions["kda_forward"].graphs() == 0  # the stateful path never ran


def test_each_mix_and_norm_is_one_compiled_call_each_way_and_keeps_its_sources(monkeypatch):
    """The learner's mix-and-norm node (``model.attnres._MixNormNode``): each sub-layer's mix runs its compiled
    forward once and its compiled closed-form backward once a train step (a checkpoint ran the forward a second
    time in backward), keeps nothing but its sources and weights, and the step's gradients equal eager's."""
    from model.attnres import AttnResMix, _MixNormNode
    from model.compile import CompiledOrEager

    model = _small_model(num_hidden_layers=4, attn_res_block_size=2).train()
    ids = torch.randint(0, 128, (1, 40))
    loss_ref, grads_ref = _step(model, ids)
    regions = {r.name: r for r in compile_regions(model, backend=CountingBackend())}
    calls = {"attn_res_mix_norm": 0, "attn_res_mix_norm_grads": 0, "normed": 0}
    real_call, real_normed = CompiledOrEager.__call__, AttnResMix.normed

    def counting_call(self, *args):
        if self.name in calls:
            calls[self.name] += 1
        return real_call(self, *args)

    def counting_normed(self, sources, norm, shared=None):
        calls["normed"] += len(sources) > 1
        return real_normed(self, sources, norm, shared)

    kept: list[torch.Tensor] = []
    real_forward = _MixNormNode.forward

    def keeping_forward(ctx, *args):
        out = real_forward(ctx, *args)
        kept.append({t.data_ptr() for t in ctx.saved_tensors} - {t.data_ptr() for t in args[1:] if torch.is_tensor(t)})
        return out

    monkeypatch.setattr(CompiledOrEager, "__call__", counting_call)
    monkeypatch.setattr(AttnResMix, "normed", counting_normed)
    monkeypatch.setattr(_MixNormNode, "forward", staticmethod(keeping_forward))
    loss, grads = _step(model, ids)
    assert calls["normed"] >= 3
    assert calls["attn_res_mix_norm"] == calls["attn_res_mix_norm_grads"] == calls["normed"]
    assert len(kept) == calls["normed"] and not any(kept)  # only its own inputs: sources and weights
    assert regions["attn_res_mix_norm_grads"].failed is None
    torch.testing.assert_close(loss, loss_ref)
    for a, b in zip(grads_ref, grads):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_blocks_scope_compiles_the_planned_mla_layer_as_one_graph(monkeypatch):
    """An MLA layer without a cache whose attention takes the one-call ``varlen`` form (half-precision compute)
    takes the planned path: the layout's offsets and longest length handed over, so scope "blocks" compiles the
    whole layer, dynamo breaks nowhere, other layouts stop adding graphs after the second, and the compiled
    layer gives the eager planned path's output and gradients, which agree with the per-sequence SDPA reference
    to bf16 rounding. Flash attention has no CPU kernel: a dense masked SDPA over the same rows stands in for
    ``model.attention.varlen_rows``."""
    import torch.nn.functional as F

    import model.attention as attention
    from model.mla import GatedMLA, mla_planned_forward

    def dense_varlen(q_RHQ, k_RHQ, v_RHV, cu_N1, max_len, scale):
        R = q_RHQ.shape[0]
        seq_R = torch.searchsorted(cu_N1[1:].long(), torch.arange(R), right=True)
        mask = (seq_R[:, None] == seq_R[None, :]) & (torch.arange(R)[:, None] >= torch.arange(R)[None, :])
        q, k, v = (t.transpose(0, 1) for t in (q_RHQ, k_RHQ, v_RHV))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)

    monkeypatch.setattr(attention, "varlen_rows", dense_varlen)
    model = _small_model(num_hidden_layers=2).train()
    attn = next(m for m in model.modules() if isinstance(m, GatedMLA))
    # the reference: one SDPA per sequence
    regions = _check_planned_layer(model, attn, [[1, 15, 64, 65], [15, 64, 3], [7, 33], [1, 15, 64, 65]],
                                   "attention=varlen", "attention=loop", {"rtol": 2e-2, "atol": 2e-2}, autocast=True)  # fmt: skip
    planned = regions["mla_planned_forward"]
    assert planned.failed is None and planned.eager is mla_planned_forward and attn.planned_fn is planned


def test_cuda_graphs_go_to_the_blocks_asked_for():
    """``cuda_graphs``: True / "blocks" every compiled block of the scope replays as CUDA graphs, "moe" the MoE
    blocks only (what ``learner.cuda_graphs`` asks for), never a small region; a graph of a block not compiled
    whole (scope "regions") or an unknown value is refused."""
    model = _small_model()

    def graphed(**kw):
        torch._dynamo.reset()
        return {r.name for r in compile_regions(model, backend="inductor", scope="blocks", **kw)
                if (r.options or {}).get("triton.cudagraphs")}  # fmt: skip

    assert graphed(cuda_graphs="moe") == {"sparse_moe_forward"}
    every = graphed(cuda_graphs=True)
    assert "sparse_moe_forward" in every and "kda_forward" in every and graphed(cuda_graphs="blocks") == every
    assert graphed() == set()
    with pytest.raises(ValueError, match="needs compile scope 'moe' or 'blocks'"):
        compile_regions(model, backend="aot_eager", scope="regions", cuda_graphs="moe")
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        compile_regions(model, backend="aot_eager", scope="blocks", cuda_graphs="kda")
