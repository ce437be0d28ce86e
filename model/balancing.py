"""Expert-load balancing for the sigmoid router's selection bias (no auxiliary loss).

The router picks experts by top-k of (s + b) and weighs them with the unbiased s; only b is
balanced here, outside autograd. Modes (``HybridConfig.moe_balancing``):

* "quantile" - K3's Quantile Balancing (K3 Eq. 14, App. C; J. Su, kexue.fm/archives/11619).
  Per step: route with top-(k+1) of (s + b), the (k+1)-th value is the token's cutoff alpha_i;
  margins r_ij = s_ij - alpha_i; b_hat_j = -[(q+1)-th largest of r_{:,j}] with q = floor(m k / n);
  b <- b_hat - mean(b_hat), applied from the NEXT step. The closed form has no step size. It keeps
  every margin of the step ([m, E] fp32 per layer), so it is the small-scale mode.
* "quantile_histogram" - the same b_hat from per-expert histograms of the required bias
  rho_ij = alpha_i - s_ij over [b_min - 1, b_max + 1] (K3 App. D, ~1000 bins, linear interpolation
  inside the bin). Counts add across micro-batches (and, at scale, across ranks with one integer
  all-reduce; this module never reads a rank: the caller reduces ``hist_EB`` if it wants to).
* "load_quantile" - a proportional rule in load space, b_e += eta * (quantile_p(load) - load_e) with
  loads in units of the mean load (Loss-Free Balancing's update referenced to a load quantile). It
  has a step size and is not K3's QB; kept as an ablation.
* "sign" - DeepSeek-V3's loss-free rule b_e += gamma * sign(mean_load - load_e).
* "frozen" - no statistics, no updates (the RL default: rollout and learner must route alike).

Deviation: the exact mode floors q = m k / n when it is fractional (the LP is solved on integer
capacities); the histogram mode interpolates at the fractional rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

MODES = ("quantile", "quantile_histogram", "load_quantile", "sign", "frozen")


# ----------------------------------------------------------------------------- pure functions
def quantile_bias(margins_ME: torch.Tensor, k: int) -> torch.Tensor:
    """K3 QB closed form: b_hat_j = -(q+1)-th largest margin of expert j, mean-centred."""
    m, n = margins_ME.shape
    q = min(int(m * k // n), m - 1)
    # the (q+1)-th largest = the (m-q)-th smallest; kthvalue along a contiguous row is fastest
    beta_E = margins_ME.float().t().contiguous().kthvalue(m - q, dim=1).values
    b_hat = -beta_E
    return b_hat - b_hat.mean()


def histogram_range(bias_E: torch.Tensor) -> tuple[float, float]:
    """rho = alpha - s lies in [b_min - 1, b_max + 1] for sigmoid scores."""
    return float(bias_E.min()) - 1.0, float(bias_E.max()) + 1.0


def required_bias_histogram(rho_ME: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """Integer counts [E, bins] of rho per expert over uniform bins of [lo, hi]."""
    _m, n = rho_ME.shape
    width = (hi - lo) / bins
    idx_ME = ((rho_ME.float() - lo) / width).floor().clamp(0, bins - 1).long()
    flat = (idx_ME + torch.arange(n, device=rho_ME.device) * bins).reshape(-1)
    return torch.bincount(flat, minlength=n * bins).view(n, bins)


def histogram_quantile_bias(hist_EB: torch.Tensor, lo: float, hi: float, m: int, k: int) -> torch.Tensor:
    """b_hat_j = the (q+1)-th smallest rho of expert j (q = m k / n) read from the histogram."""
    n, bins = hist_EB.shape
    width = (hi - lo) / bins
    target = min(m * k / n + 1.0, float(m))
    cum_EB = hist_EB.cumsum(dim=1).double()
    bin_E = (cum_EB < target).sum(dim=1).clamp(max=bins - 1)
    below_E = torch.where(bin_E > 0, cum_EB.gather(1, (bin_E - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    count_E = hist_EB.gather(1, bin_E[:, None])[:, 0].double().clamp(min=1.0)
    frac_E = ((target - below_E) / count_E).clamp(0.0, 1.0)
    b_hat = (lo + (bin_E.double() + frac_E) * width).float()
    return b_hat - b_hat.mean()


def load_quantile_update(bias_E: torch.Tensor, load_E: torch.Tensor, eta: float, p: float) -> torch.Tensor:
    rel_E = load_E.float() / load_E.float().mean().clamp(min=1e-9)
    return bias_E + eta * (torch.quantile(rel_E, p) - rel_E)


def sign_update(bias_E: torch.Tensor, load_E: torch.Tensor, gamma: float) -> torch.Tensor:
    load_E = load_E.float()
    return bias_E + gamma * torch.sign(load_E.mean() - load_E)


@dataclass
class LoadMetrics:
    """Per-layer balance of one step (loads are token-expert assignments)."""

    max_vio: float  # (max load - mean load) / mean load  ("MaxVio_batch")
    load_cv: float  # std / mean
    dead_experts: int  # load < dead_fraction * mean load
    min_load_frac: float  # min load / mean load


def load_metrics(load_E: torch.Tensor, dead_fraction: float = 0.01) -> LoadMetrics:
    load_E = load_E.float()
    mean = load_E.mean().clamp(min=1e-9)
    return LoadMetrics(
        max_vio=float((load_E.max() - mean) / mean),
        load_cv=float(load_E.std(unbiased=False) / mean),
        dead_experts=int((load_E < dead_fraction * mean).sum()),
        min_load_frac=float(load_E.min() / mean),
    )


# ----------------------------------------------------------------------------- per-step statistics
@dataclass
class RoutingStats:
    """What one MoE layer saw during one optimizer step (summed over micro-batches)."""

    load_E: torch.Tensor
    tokens: int = 0
    margins: list[torch.Tensor] = field(default_factory=list)  # exact QB: [m_i, E] per micro-batch
    hist_EB: torch.Tensor | None = None
    hist_range: tuple[float, float] | None = None

    def record(
        self,
        mode: str,
        scores_TE: torch.Tensor,
        cutoff_T: torch.Tensor,
        chosen_TK: torch.Tensor,
        bias_E,
        bins: int,
    ) -> None:
        scores_TE, cutoff_T = scores_TE.detach().float(), cutoff_T.detach().float()
        # scatter_add, not bincount: CUDA bincount reads the maximum on the host (one sync per layer)
        flat = chosen_TK.reshape(-1).long()
        self.load_E += torch.zeros_like(self.load_E).scatter_add_(0, flat, torch.ones_like(flat).to(self.load_E))
        self.tokens += scores_TE.shape[0]
        if mode == "quantile":
            self.margins.append(scores_TE - cutoff_T[:, None])
        elif mode == "quantile_histogram":
            if self.hist_range is None:
                self.hist_range = histogram_range(bias_E)
            rho_TE = cutoff_T[:, None] - scores_TE
            hist = required_bias_histogram(rho_TE, *self.hist_range, bins)
            self.hist_EB = hist if self.hist_EB is None else self.hist_EB + hist


class ExpertBalancer:
    """Updates every MoE router's selection bias once per optimizer step.

    Usage: ``balancer = ExpertBalancer(model)``; run forward/backward over the step's micro-batches
    in train mode; after ``optimizer.step()`` call ``metrics = balancer.step()``. Works on any module
    tree containing ``model.moe.MoEGate`` routers. Its state (mode, hyperparameters, step count and
    the biases) round-trips through ``state_dict`` / ``load_state_dict`` for checkpoints.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        mode: str | None = None,
        rate: float | None = None,
        bins: int | None = None,
        quantile: float | None = None,
        dead_fraction: float = 0.01,
    ) -> None:
        from model.moe import MoEGate  # model.moe imports this module's functions

        self.gates: list[MoEGate] = [m for m in model.modules() if isinstance(m, MoEGate)]
        if not self.gates:
            raise ValueError("ExpertBalancer: the model has no MoE routers (MoEGate modules)")
        cfg = self.gates[0]
        self.mode = mode or cfg.balancing_mode
        if self.mode not in MODES:
            raise ValueError(f"balancing mode must be one of {MODES}, got {self.mode!r}")
        self.rate = cfg.balancing_rate if rate is None else rate
        self.bins = cfg.balancing_bins if bins is None else bins
        self.quantile = cfg.balancing_quantile if quantile is None else quantile
        self.dead_fraction = dead_fraction
        self.num_steps = 0
        for gate in self.gates:
            gate.set_balancing(self.mode, self.bins)

    def step(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[LoadMetrics]:
        """Turn the step's statistics into next step's biases; return per-layer metrics.

        ``all_reduce`` (sum over data-parallel ranks, supplied by the caller; this module never reads a
        rank) is applied to the integer statistics: loads, token counts and, in the histogram mode,
        the [E, bins] counts - K3's one integer all-reduce per layer. The exact mode needs every
        margin, which does not reduce by summation: use "quantile_histogram" across ranks.
        """
        if all_reduce is not None and self.mode == "quantile":
            raise ValueError('exact "quantile" balancing cannot all-reduce margins; use "quantile_histogram"')
        metrics = []
        for gate in self.gates:
            stats = gate.pop_stats()
            if all_reduce is not None:  # every rank joins the collective, even one that saw no tokens
                stats = _reduced(stats or gate.empty_stats(), all_reduce)
            if stats is None or stats.tokens == 0:
                continue
            metrics.append(load_metrics(stats.load_E, self.dead_fraction))
            new_bias = self._new_bias(gate, stats)
            if new_bias is not None:
                gate.e_score_correction_bias.copy_(new_bias.to(gate.e_score_correction_bias))
        self.num_steps += 1
        return metrics

    @torch.no_grad()
    def _new_bias(self, gate, stats: RoutingStats) -> torch.Tensor | None:
        bias_E, k = gate.e_score_correction_bias.float(), gate.top_k
        if self.mode == "quantile":
            return quantile_bias(torch.cat(stats.margins), k)
        if self.mode == "quantile_histogram":
            return histogram_quantile_bias(stats.hist_EB, *stats.hist_range, stats.tokens, k)
        if self.mode == "load_quantile":
            return load_quantile_update(bias_E, stats.load_E, self.rate, self.quantile)
        if self.mode == "sign":
            return sign_update(bias_E, stats.load_E, self.rate)
        return None  # frozen

    @staticmethod
    def summarize(metrics: list[LoadMetrics]) -> dict[str, float]:
        """Flat scalars for logging: worst and mean over layers."""
        if not metrics:
            return {}
        rows = [asdict(m) for m in metrics]
        out = {f"moe/max_vio_layer{i}": r["max_vio"] for i, r in enumerate(rows)}
        out["moe/max_vio_max"] = max(r["max_vio"] for r in rows)
        out["moe/load_cv_mean"] = sum(r["load_cv"] for r in rows) / len(rows)
        out["moe/dead_experts"] = float(sum(r["dead_experts"] for r in rows))
        return out

    def state_dict(self) -> dict:
        return {
            "mode": self.mode,
            "rate": self.rate,
            "bins": self.bins,
            "quantile": self.quantile,
            "dead_fraction": self.dead_fraction,
            "num_steps": self.num_steps,
            "biases": [g.e_score_correction_bias.detach().clone() for g in self.gates],
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["biases"]) != len(self.gates):
            raise ValueError(
                f"balancer state has {len(state['biases'])} routers, the model {len(self.gates)}"
            )
        self.mode, self.rate, self.bins = state["mode"], state["rate"], state["bins"]
        self.quantile, self.dead_fraction = state["quantile"], state["dead_fraction"]
        self.num_steps = state["num_steps"]
        for gate, bias in zip(self.gates, state["biases"]):
            gate.e_score_correction_bias.data.copy_(bias)
            gate.set_balancing(self.mode, self.bins)


def _reduced(stats: RoutingStats, all_reduce) -> RoutingStats:
    """Sum the step's integer statistics over ranks (same call order on every rank)."""
    load_E = all_reduce(stats.load_E.round().long()).to(stats.load_E)
    tokens = int(all_reduce(torch.tensor([stats.tokens], device=stats.load_E.device)).item())
    hist = all_reduce(stats.hist_EB) if stats.hist_EB is not None else None
    return RoutingStats(load_E, tokens, stats.margins, hist, stats.hist_range)
