"""How often a small relative error in the router's logits changes a token's expert set (CPU, seconds).

    python bench/route_ties.py [--preset gpu_1b] [--logit-std 3.0] [--decisions 1000000]
                               [--errors 1e-7,1e-6,1e-5] [--check-decisions 96675]

Two engines that compute the same model with different fp32 roundings (bench/rollout_throughput.py's fast path
against its eager reference) feed each router inputs that differ in their last bits. A top-k over many experts
has a near-tie between its k-th and (k+1)-th score somewhere in a long prompt, and there the two engines choose
different experts; that token's MoE output changes by O(1) of one expert's share and the engines part. This
script puts a number on it for a preset's router, as the model computes it: logits drawn i.i.d. normal with
``--logit-std`` (bench/rollout_gpu.py scales the random init's router to a std of 3), each multiplied by
(1 + error x N(0, 1)) for the second engine, both through ``sigmoid`` and ``model.moe.top_experts`` (the
model's own selection, ties to the lower expert id), the sets compared.

Per relative error: the fraction of decisions whose set changed, with the count behind it, and for a check
of ``--check-decisions`` token-layers (the 2026-12-06 fp32 check: 4 prompts x ~1.6K tokens x 15 MoE
layers) the expected number of changed sets and the chance that none changes (Poisson). Results:
``<out>/route_ties.json`` and the table on stdout.

``selection_gaps`` / ``flip_gap`` read the other side off a real model: how near a tie a given token-layer's
selection was (bench/rollout_throughput.py reports it for each check prompt's first changed set).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.config import HybridConfig  # noqa: E402
from model.moe import MoEGate, top_experts  # noqa: E402


def changed_sets(logits_TE: torch.Tensor, error: float, k: int, gen: torch.Generator) -> int:
    """Tokens whose top-k experts of sigmoid(logits) change when each logit is scaled by 1 + error x N(0, 1)."""
    noisy_TE = logits_TE * (1 + error * torch.randn(logits_TE.shape, generator=gen))
    a_TK = top_experts(torch.sigmoid(logits_TE), k)[1].sort(dim=1).values
    b_TK = top_experts(torch.sigmoid(noisy_TE), k)[1].sort(dim=1).values
    return int((a_TK != b_TK).any(dim=1).sum())


def rate(
    experts: int, k: int, std: float, error: float, decisions: int, seed: int, chunk: int = 50_000
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    changed = done = 0
    while done < decisions:
        n = min(chunk, decisions - done)
        logits_TE = std * torch.randn(n, experts, generator=gen)
        changed += changed_sets(logits_TE, error, k, gen)
        done += n
    return {"error": error, "decisions": done, "changed": changed, "per_decision": changed / done}


def selection_gaps(model, tokens: list[int]) -> torch.Tensor:
    """[T, L]: how far each token's expert set is from a tie at each MoE layer, as ``model`` (a learner, eval mode, its
    own dtype and device) routes ``tokens`` in one forward: the gap between the k-th and the (k+1)-th selection score
    (sigmoid of the logit plus the selection bias, what the top-k ranks). A set two engines chose differently with a
    gap near the floor of the gaps here was a near-tie; one with a typical gap would point at a defect."""
    gates = [m for m in model.modules() if isinstance(m, MoEGate)]
    if not gates:
        raise ValueError("selection_gaps: the model has no MoE router")
    gaps: dict[int, torch.Tensor] = {}

    def capturing(i: int, top):
        def top_fn(biased_TE: torch.Tensor, n: int):
            vals_TE = biased_TE.sort(dim=-1, descending=True).values
            gaps[i] = (vals_TE[:, n - 1] - vals_TE[:, n]).float().cpu()
            return top(biased_TE, n)

        return top_fn

    saved = [(g.top_fn, g.select_fn) for g in gates]
    try:
        for i, g in enumerate(gates):
            g.top_fn, g.select_fn = capturing(i, g.top_fn), None  # the selection in steps, through top_fn
        with torch.no_grad():
            model(torch.tensor([tokens], device=next(model.parameters()).device))
    finally:
        for g, (top, select) in zip(gates, saved):
            g.top_fn, g.select_fn = top, select
    return torch.stack([gaps[i] for i in range(len(gates))], dim=1)


def flip_gap(model, tokens: list[int], position: int, layer: int) -> dict:
    """The selection gap where two engines first chose different experts (``position`` in ``tokens``, the
    ``layer``-th MoE layer), against every gap of the sequence up to it: its quantile among them (0: the
    nearest tie of all) and their median."""
    if not 0 <= position < len(tokens):
        raise ValueError(f"flip_gap: position {position} outside the {len(tokens)} tokens")
    gaps_TL = selection_gaps(model, tokens[: position + 1])
    if not 0 <= layer < gaps_TL.shape[1]:
        raise ValueError(f"flip_gap: MoE layer {layer} outside the model's {gaps_TL.shape[1]}")
    gap = float(gaps_TL[position, layer])
    return {"position": position, "layer": layer, "gap": gap, "median_gap": float(gaps_TL.median()),
            "quantile": int((gaps_TL < gap).sum()) / gaps_TL.numel(), "token_layers": gaps_TL.numel()}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpu_1b", help="configs/model/<preset>.yaml: experts and top-k")
    p.add_argument("--logit-std", type=float, default=3.0)
    p.add_argument("--decisions", type=int, default=1_000_000, help="token-layers drawn per error")
    p.add_argument("--errors", default="1e-7,1e-6,1e-5", help="relative errors of the second engine's logits")
    p.add_argument("--check-decisions", type=int, default=96_675, help="token-layers of the check to predict")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "runs/route_ties")
    args = p.parse_args()
    errors = [float(e) for e in args.errors.split(",") if e.strip()]
    if args.decisions <= 0 or not errors or any(e <= 0 for e in errors):
        p.error("--decisions and every --errors value must be positive")
    cfg = HybridConfig.from_yaml(ROOT / f"configs/model/{args.preset}.yaml")
    E, k = cfg.num_experts, cfg.num_experts_per_token
    print(f"{args.preset}: top-{k} of {E} experts, sigmoid scores, logit std {args.logit_std}", flush=True)
    print("| relative error | changed sets / decisions | per decision | expected in the check | P(none) |")
    print("|---|---|---|---|---|")
    rows = []
    for error in errors:
        t0 = time.time()
        row = rate(E, k, args.logit_std, error, args.decisions, args.seed)
        row["expected_in_check"] = row["per_decision"] * args.check_decisions
        row["p_none_in_check"] = math.exp(-row["expected_in_check"])
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"| {error:g} | {row['changed']} / {row['decisions']:,} | {row['per_decision']:.1e} | "
              f"{row['expected_in_check']:.2f} | {row['p_none_in_check']:.2f} |", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "experts": E, "top_k": k, "logit_std": args.logit_std,
              "check_decisions": args.check_decisions, "rows": rows}  # fmt: skip
    (args.out / "route_ties.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
