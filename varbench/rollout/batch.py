"""RolloutBatch: G sampled responses for each of P prompts, in the [P, G, T] layout.

Every later part of varbench (gradients, estimators, analyses, training) consumes this
structure. The flat ``[B, L]`` view (B = P * G, row b = p * G + i) is what a model forward needs:
``input_ids = [left-padded prompt | right-padded response]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FlatBatch:
    """Model-ready view of a RolloutBatch. All tensors are [B, L] with B = P * G."""

    input_ids: torch.Tensor  # [B, L] prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens (prompt, policy and env tokens)
    response_mask: torch.Tensor  # [B, L] 1 where input_ids[b, t] is a policy token that counts
    prompt_len: int  # Lp: response position t of the [P, G, T] layout is column Lp + t


@dataclass
class RolloutBatch:
    """G responses per prompt for P prompts.

    Shapes: ``tokens``, ``mask``, ``env_mask``, ``logprobs``, ``sum_pi_sq``, ``entropy`` are
    ``[P, G, T]``; ``rewards`` and ``lengths`` are ``[P, G]``; ``prompt_ids`` and
    ``prompt_mask`` are ``[P, Lp]`` (left-padded). ``mask`` is 1 on tokens the policy generated
    and that count in the loss; environment (tool output) tokens have ``mask == 0`` and
    ``env_mask == 1``; padding has both 0. ``logprobs``/``sum_pi_sq``/``entropy`` are those of the
    sampling policy and exactly 0 where ``mask == 0``. ``lengths`` counts policy tokens (mask sum).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    env_mask: torch.Tensor
    logprobs: torch.Tensor
    sum_pi_sq: torch.Tensor
    entropy: torch.Tensor
    rewards: torch.Tensor
    lengths: torch.Tensor
    prompts: list[str] = field(default_factory=list)  # P prompt texts
    texts: list[list[str]] = field(default_factory=list)  # P x G decoded responses
    meta: dict = field(default_factory=dict)  # task name, reward name, seed, ...

    @property
    def P(self) -> int:  # noqa: N802 - the paper's notation
        return self.tokens.shape[0]

    @property
    def G(self) -> int:  # noqa: N802
        return self.tokens.shape[1]

    @property
    def T(self) -> int:  # noqa: N802
        return self.tokens.shape[2]

    def flat(self) -> FlatBatch:
        """Return the [B, L] view: input_ids, attention_mask, response_mask (B = P * G)."""
        P, G, T = self.tokens.shape
        Lp = self.prompt_ids.shape[1]
        prompt = self.prompt_ids.unsqueeze(1).expand(P, G, Lp)
        pmask = self.prompt_mask.unsqueeze(1).expand(P, G, Lp)
        real = (self.mask + self.env_mask).clamp(max=1)
        input_ids = torch.cat([prompt, self.tokens], dim=-1).reshape(P * G, Lp + T)
        attention = torch.cat([pmask, real], dim=-1).reshape(P * G, Lp + T)
        response = torch.cat([torch.zeros_like(pmask), self.mask], dim=-1).reshape(P * G, Lp + T)
        return FlatBatch(
            input_ids=input_ids.long(),
            attention_mask=attention.long(),
            response_mask=response.to(self.mask.dtype),
            prompt_len=Lp,
        )

    def to_groups(self, flat: torch.Tensor) -> torch.Tensor:
        """Map a [B, L] per-position tensor from ``flat()`` back to the [P, G, T] layout."""
        P, G, T = self.tokens.shape
        return flat[:, self.prompt_ids.shape[1] :].reshape(P, G, T, *flat.shape[2:])
