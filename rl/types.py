"""The learner's input record: episodes packed varlen into one flat token stream.

Shape legend: T = packed tokens of the micro-batch, N = episodes (sequences) in it, L = MoE layers,
K = experts per token. ``cu_seqlens_N1`` holds the sequence boundaries, so the model's recurrent
state and attention never cross from one episode into the next.

Alignment: the value at token position t describes token t itself. ``rollout_logprobs_T[t]`` is the
logprob the engine gave token t when it sampled it, and the learner compares it with
log_softmax(logits[t - 1])[input_ids[t]]. ``routed_experts_TLK[t]`` holds the experts the engine
routed token t to when it processed that token as input -- prompt, template, observation and sampled
tokens alike, as the turn that first computed the token recorded it (rollout/worker.py) -- and -1
where the engine computed no such token: positions a stock prefix-cache hit served from another
request, and each episode's last sampled token (never fed; its routes change only the logits after
the last token, which no loss reads). The learner routes -1 tokens freely (rl/learner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class TrainBatch:
    input_ids_T: torch.Tensor  # [T] long
    cu_seqlens_N1: torch.Tensor  # [N+1] int32, starts at 0, ends at T
    loss_mask_T: torch.Tensor  # [T] bool, True on sampled assistant tokens only
    advantages_T: torch.Tensor  # [T] float32, 0 where loss_mask is False
    rollout_logprobs_T: torch.Tensor  # [T] float32, 0 where loss_mask is False
    token_weights_T: torch.Tensor  # [T] float32 loss aggregation weights (rl/losses.py)
    seq_ids_T: torch.Tensor  # [T] long, 0..N-1
    value_mask_T: torch.Tensor  # [T] bool, turn boundaries where the value head is read
    value_targets_T: torch.Tensor  # [T] float32, GAE targets at turn boundaries
    value_weights_T: torch.Tensor  # [T] float32, value-loss weights (sum to 1 over the optimizer step)
    routed_experts_TLK: torch.Tensor | None = None  # [T, L, K] int32, -1 = the engine computed none
    episode_ids: list[str] = field(default_factory=list)  # [N]
    padding: bool = False  # a learner group's filler: zero loss weights, adds nothing (rl/learner_group.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens_N1.numel()) - 1

    def select(self, first: int, last: int) -> TrainBatch:
        """Sequences first..last-1 as a batch of their own (seq ids and cu_seqlens re-based)."""
        cu = self.cu_seqlens_N1
        lo, hi = int(cu[first]), int(cu[last])
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "cu_seqlens_N1":
                out[f.name] = cu[first : last + 1] - lo
            elif f.name == "seq_ids_T":
                out[f.name] = v[lo:hi] - first
            elif f.name == "episode_ids":
                out[f.name] = v[first:last]
            elif isinstance(v, torch.Tensor):
                out[f.name] = v[lo:hi]
            else:
                out[f.name] = v
        return TrainBatch(**out)

    def split(self, max_tokens: int) -> list[TrainBatch]:
        """Micro-batches of whole sequences with at most ``max_tokens`` tokens (a longer sequence alone)."""
        lengths = (self.cu_seqlens_N1[1:] - self.cu_seqlens_N1[:-1]).tolist()
        out, first, used = [], 0, 0
        for i, n in enumerate(lengths):
            if used and used + n > max_tokens:
                out.append(self.select(first, i))
                first, used = i, 0
            used += n
        if used or not out:
            out.append(self.select(first, len(lengths)))
        return out

    def to(self, device: torch.device | str) -> TrainBatch:
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vals.items()})
