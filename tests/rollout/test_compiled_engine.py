"""The engine's fast path (``enforce_eager=False``): our model's element-wise regions compiled inside vLLM
(``rollout.vllm_model``; on a GPU vLLM then captures CUDA graphs over them). It must give the eager
engine's tokens: greedy decoding equal to ``model.generate``, sampled logprobs equal to the learner's, and
every region, the KDA decode step's included, compiled without falling back, and the routes recorded for
replay equal to the learner's router. The aot_eager backend stands
in for inductor here (the same dynamo capture and graphs, no C++ builds on the 2-core box; inductor itself
is held to eager in tests/model/test_compile.py)."""

from __future__ import annotations

import os

import pytest
import test_vllm_engine as engine_tests
import torch
from rollout_cases import SMALL_ENGINE
from test_vllm_engine import _prompt, assert_sampled_logprobs_equal_learner

from rollout.worker import TurnRequest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def compiled_worker(tiny_ckpt):
    from rollout.worker import RolloutWorker

    mp = pytest.MonkeyPatch()
    mp.setenv("LONGHORIZON_COMPILE_BACKEND", "aot_eager")  # read when the in-process engine builds the model
    torch._dynamo.reset()  # the graphs counted below are this engine's, not an earlier test's in this process
    w = RolloutWorker(dict(model_path=str(tiny_ckpt[0]), reuse="session", enforce_eager=False, **SMALL_ENGINE))
    yield w
    w.shutdown()
    mp.undo()


def _engine_model(worker):
    return worker.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def test_compiled_engine_decodes_like_the_learner(compiled_worker, tiny_ckpt):
    _, model = tiny_ckpt
    prompts = {"c0": _prompt(0, 40), "c1": _prompt(1, 75)}
    reqs = [TurnRequest(s, p, max_tokens=12, temperature=0.0) for s, p in prompts.items()]
    for o in compiled_worker.generate(reqs):
        ref = model.generate(torch.tensor([prompts[o.session_id]]), max_new_tokens=12)[0, -12:].tolist()
        assert o.token_ids == ref
    compiled_worker.end_sessions(list(prompts))
    assert_sampled_logprobs_equal_learner(compiled_worker, model, "c2", _prompt(2, 60))

    regions = {r.name: r for r in _engine_model(compiled_worker).compiled_regions}
    assert {"rms_norm", "attn_res_mix", "glu_activation", "kda_gates", "kda_output_gate",
            "kda_decode_inputs"} <= set(regions)  # fmt: skip
    assert all(r.failed is None for r in regions.values()), {n: r.failed for n, r in regions.items() if r.failed}
    assert regions["kda_decode_inputs"].graphs() >= 1  # decode steps went through the compiled region
    # one graph for decode and prefill alike (the decode step calls the output gate as the prefill does) and
    # for the mixes of any number of sources (stacked), plus one for the steps of a single token (c2 decoding
    # alone: dynamo's 0/1 rule; the GPU engine pads its steps to CUDA-graph sizes of 2 and more); before,
    # each rank and each number of sources was another compile (1.3-1.8 s each on the H200)
    assert regions["kda_output_gate"].graphs() == 2
    assert regions["attn_res_mix_stacked"].graphs() == 2 and not regions["attn_res_mix"].graphs()
    # the start-up's compile record (bench/startup_probe.py prints it) saw every compile inside the engine
    from model.compile import compile_record

    record = compile_record()
    for name, r in regions.items():
        if r.graphs():
            assert record.get(name, {}).get("compiles", 0) >= r.graphs(), (name, record.get(name))


def test_compiled_engine_records_the_learners_routes(compiled_worker, tiny_ckpt):
    """Routing replay's records come from the engine's route buffer (written inside the forward, so CUDA
    graph replays refresh it): prompt and sampled tokens' experts equal the learner's router."""
    engine_tests.test_routed_experts_match_the_learners_router(compiled_worker, tiny_ckpt)


def test_eager_engine_compiles_nothing(session_worker):
    assert _engine_model(session_worker).compiled_regions == []


def test_inductor_compile_threads_default_on_gpu_and_checked(monkeypatch):
    """``LONGHORIZON_COMPILE_THREADS`` sets inductor's compile workers (``import vllm`` pins them to 1);
    unset leaves them on a CPU and sets the default (capped by the cores) on a GPU, and a value that is not
    a positive integer is named."""
    import torch._inductor.config as inductor_config

    from model.serving import DEFAULT_COMPILE_THREADS, inductor_compile_threads

    # inductor's own patch, not monkeypatch: undoing a setattr on its config module deleted the key, and every
    # later inductor compile of the process then failed on the missing setting
    with inductor_config.patch(compile_threads=1):
        assert inductor_compile_threads(None) is None and inductor_config.compile_threads == 1
        assert inductor_compile_threads("6") == 6 and inductor_config.compile_threads == 6
        monkeypatch.setattr(os, "cpu_count", lambda: 16)
        assert inductor_compile_threads(None, on_cuda=True) == DEFAULT_COMPILE_THREADS == inductor_config.compile_threads
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        assert inductor_compile_threads("", on_cuda=True) == 2 and inductor_compile_threads("3", on_cuda=True) == 3
    assert hasattr(inductor_config, "compile_threads")
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError, match="LONGHORIZON_COMPILE_THREADS must be a positive integer"):
            inductor_compile_threads(bad)


def test_engine_counts_routes_over_its_largest_step(compiled_worker):
    """Every grouped MoE of the engine ranks its route layout by counting up to the scheduler's token budget
    (``counting_layout_over``): no step it can form crosses to the sorting path."""
    from model.moe import GroupedExperts

    model = _engine_model(compiled_worker)
    rows = compiled_worker.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    grouped = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    k = model.config.num_experts_per_token
    assert grouped and all(m.counting_layout_max >= rows * k * m.num_experts for m in grouped)


def test_one_route_path_compiles_the_moe_block_once(monkeypatch):
    """A compiled MoE block across step sizes on both sides of the counting limit: two compiles (the choice
    is a guard on the token count), one once ``counting_layout_over`` covers the largest step. bf16: the
    grouped GEMM traces on the CPU only in bf16."""
    import kernels.moe as moe_kernels
    from model.compile import compile_regions
    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from model.serving import counting_layout_over

    config = HybridConfig.from_yaml(os.path.join(os.path.dirname(__file__), "../../configs/model/cpu_tiny.yaml"))
    k, E = config.num_experts_per_token, config.num_experts
    monkeypatch.setattr(moe_kernels, "COUNTING_LAYOUT_MAX", 40 * k * E)  # steps over 40 tokens sort
    torch.manual_seed(0)

    def compiles(raise_limit: bool) -> int:
        torch._dynamo.reset()
        model = HybridForCausalLM(config).eval().to(torch.bfloat16)
        if raise_limit:
            counting_layout_over(model, 200 * k)
        graphs = []
        compile_regions(model, lambda gm, ex: graphs.append(1) or gm.forward, scope="moe")
        with torch.inference_mode():
            for T in (160, 24, 8):  # a large step first, as vLLM's profile run, then decode-sized ones
                model(torch.randint(0, config.vocab_size, (1, T)))
        block = next(m for m in model.modules() if type(m).__name__ == "SparseMoE").forward_fn
        assert block.failed is None, block.failed
        return block.graphs()

    assert compiles(raise_limit=False) == 2
    assert compiles(raise_limit=True) == 1
    monkeypatch.setattr("model.serving.COUNTING_LAYOUT_ENGINE_MAX", 100 * k * E)  # a budget past the cap
    assert compiles(raise_limit=True) == 2  # the 160-token step sorts again


def test_the_engines_routing_ops_trace_in_a_compiled_moe_block_and_change_nothing(monkeypatch):
    """``route_decode_steps_in_single_launches`` (what the engine does on CUDA): a MoE block compiled whole calls the
    selection, layout and SiTU experts' ops (custom ops: their size rules are no guards, so one compile across step
    sizes) and computes the same logits as the block with the traced sort, layout and activation, bit for bit (the
    same experts and integers, the same bf16 products). On CPU the ops take their torch paths; their Triton paths
    are held to the gate's steps, ``route_tensors`` and the permuted product's SiTU in
    tests/kernels/test_moe_grouped.py. The layout op is the default (``LONGHORIZON_DECODE_ROUTE_LAYOUT=compiled``
    keeps the compiled layout; another value is a ValueError), prefill steps on the Triton kernels too unless
    ``LONGHORIZON_PREFILL_ROUTING=torch``. bf16: the grouped GEMM traces on the CPU only in bf16."""
    import copy

    from model.compile import compile_regions
    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from model.moe import GroupedExperts, MoEGate
    from model.serving import route_decode_steps_in_single_launches

    config = HybridConfig.from_yaml(os.path.join(os.path.dirname(__file__), "../../configs/model/cpu_tiny.yaml"))
    torch.manual_seed(0)
    plain = HybridForCausalLM(config).eval().to(torch.bfloat16)
    engine = copy.deepcopy(plain)
    from kernels.moe.triton import (
        permute_situ_engine,
        route_tensors_engine,
        select_experts_engine,
        top_experts_engine,
    )

    compiled = copy.deepcopy(plain)
    monkeypatch.setenv("LONGHORIZON_DECODE_ROUTE_LAYOUT", "compiled")
    route_decode_steps_in_single_launches(compiled)
    assert not any(m.route_fn is route_tensors_engine for m in compiled.modules() if isinstance(m, GroupedExperts))
    monkeypatch.setenv("LONGHORIZON_DECODE_ROUTE_LAYOUT", "sorted")
    with pytest.raises(ValueError, match="LONGHORIZON_DECODE_ROUTE_LAYOUT"):
        route_decode_steps_in_single_launches(compiled)
    monkeypatch.delenv("LONGHORIZON_DECODE_ROUTE_LAYOUT")
    import kernels.moe.triton as moe_triton

    monkeypatch.setattr(moe_triton, "_PREFILL_ON_TRITON", True)  # restored after the test, whatever it sets
    monkeypatch.setenv("LONGHORIZON_PREFILL_ROUTING", "torch")
    route_decode_steps_in_single_launches(compiled)
    assert not moe_triton._PREFILL_ON_TRITON
    monkeypatch.setenv("LONGHORIZON_PREFILL_ROUTING", "sorted")
    with pytest.raises(ValueError, match="LONGHORIZON_PREFILL_ROUTING"):
        route_decode_steps_in_single_launches(compiled)
    monkeypatch.delenv("LONGHORIZON_PREFILL_ROUTING")
    route_decode_steps_in_single_launches(engine)  # the defaults
    assert moe_triton._PREFILL_ON_TRITON

    assert all(m.route_fn is route_tensors_engine for m in engine.modules() if isinstance(m, GroupedExperts))
    gates = [m for m in engine.modules() if isinstance(m, MoEGate)]
    assert gates and all(m.top_fn is top_experts_engine and m.select_fn is select_experts_engine for m in gates)
    experts = [m for m in engine.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.act == "situ" and m.permute_glu_fn is permute_situ_engine for m in experts)
    steps = [torch.randint(0, config.vocab_size, (1, T)) for T in (160, 8)]  # a prefill-sized step, a decode one
    outs = {}
    for name, model in (("plain", plain), ("engine", engine)):
        torch._dynamo.reset()
        compile_regions(model, lambda gm, ex: gm.forward, scope="moe")
        with torch.inference_mode():
            outs[name] = [model(ids).logits for ids in steps]
        block = next(m for m in model.modules() if type(m).__name__ == "SparseMoE").forward_fn
        assert block.failed is None, block.failed
        if name == "engine":
            assert block.graphs() == 1
    assert all(torch.equal(a, b) for a, b in zip(outs["plain"], outs["engine"], strict=True))
