"""Sampling with one random stream per prompt, so a response does not depend on which batch or rank drew it.

``model.generate`` samples every row from one global generator, so the tokens
a prompt gets depend on the rows beside it and on how the prompts were split
across processes. :class:`PerPromptSampling` draws each row's token by the
Gumbel-max trick from that row's own ``torch.Generator``: ``argmax(z / T + G)``
with ``G = -log(-log U)``, ``U ~ Uniform(0, 1)``, is an exact sample from
``softmax(z / T)`` (Gumbel 1954; Maddison et al. 2014), and greedy decoding over
the perturbed scores is that sample.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def prompt_seed(seed: int, iteration: int, position: int) -> int:
    """The seed of the generator of prompt ``position`` (0-based, in the global batch) of rollout ``iteration``."""
    return (seed * 1_000_003 + iteration) * 100_003 + position


class PerPromptSampling(LogitsProcessor):
    """Turn greedy decoding into temperature sampling with one generator per row (see the module docstring).

    Args:
        seeds: one seed per row of the batch ``generate`` runs on.
        temperature: > 0.
        device: where the scores live (the generators draw there).
    """

    def __init__(self, seeds: list[int], temperature: float, device: torch.device):
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``scores / T`` plus one Gumbel draw per vocabulary entry from each row's own generator.

        Raises:
            ValueError: a batch with another number of rows than seeds.
        """
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows to sample but {len(self.generators)} seeds")
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(uniform.dtype).tiny)))
        return scores.float() / self.temperature + gumbel
