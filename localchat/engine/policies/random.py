"""Random eviction: the lower bound (RoCo's "Random" baseline)."""

from dataclasses import dataclass

import torch

from localchat.engine.policies.base import Policy


@dataclass
class Random(Policy):
    """Each unit gets a uniform random score `[H_kv, T]` at insertion; the top-`budget` survive.

    Defaults: budget 1024, local 96, seed 0.
    """

    name = "random"
    summary = "keep a random budget of units per head (lower bound)"
    seed: int = 0

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        self.gen = torch.Generator().manual_seed(self.seed)

    def observe(self, cache, n_new, ids) -> None:
        for _, layer in cache.governed_layers():
            s = layer.scores
            s[:, -n_new:] = torch.rand((s.shape[0], n_new), generator=self.gen).to(s.device)
