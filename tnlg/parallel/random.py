"""Dropout randomness that is right for tensor parallelism.

Outside sharded regions (hidden dropout on the replicated residual stream) all
TP ranks must drop the same elements: they use the default generator, seeded
identically on every TP rank. Inside sharded regions ranks must differ:
:class:`TPRandom` keeps a separate generator state per TP rank and
:meth:`TPRandom.fork` swaps it in. The sharded regions are the attention
probabilities of this rank's heads and, with sequence parallelism, everything
between the TP regions (embedding and hidden dropout on this rank's positions of
the sequence): each rank drops different elements of different tokens, as one
process would over the whole sequence.

Recomputation (activation checkpointing) must draw the same masks again:
:meth:`TPRandom.replay` runs a recomputation from the state captured at the
original forward.

Works for any device type (CPU, CUDA, ...): states are read and written
through the device's own RNG API.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["TPRandom", "seed_everything"]

_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type in ("cpu", "meta"):
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type in ("cpu", "meta"):
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class TPRandom:
    """A per-TP-rank generator state for dropout inside sharded regions."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = torch.device(device)
        self.seed(seed, tp_rank)

    def seed(self, seed: int, tp_rank: int) -> None:
        dev = "cpu" if self.device.type == "meta" else self.device
        gen = torch.Generator(device=dev).manual_seed(seed + _TP_SEED_OFFSET + 100 * tp_rank)
        self.state = gen.get_state()

    @contextlib.contextmanager
    def fork(self):
        """Run the block with this rank's generator; the default stream is untouched."""
        saved = _get_state(self.device)
        _set_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(self.device, saved)

    @contextlib.contextmanager
    def replay(self, state: Optional[torch.Tensor]):
        """Run the block from ``state`` (captured before the original forward) when it differs from the
        live state, i.e. when the block is a recomputation in backward; the live state is restored after.
        ``None`` or the live state itself: a first forward, nothing changes."""
        live = self.state
        replaying = state is not None and not torch.equal(live, state)
        if replaying:
            self.state = state.clone()
        try:
            yield
        finally:  # (a checkpoint may stop a recomputation early by raising)
            if replaying:
                self.state = live

    def state_dict(self) -> dict:
        return {"state": self.state.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd["state"].clone()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) with the same seed."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
