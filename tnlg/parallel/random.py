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
:meth:`TPRandom.snapshot` captures the state before the original forward and
:meth:`TPRandom.replay` runs a recomputation from it. Whether a block is a
recomputation is decided by a Python version counter (bumped whenever the state
changes), never by comparing tensor values: no host read, and nothing that fake
tensors (:mod:`tnlg.plan.simulate`) or a compiler's tracing cannot follow. States are
never modified in place (each draw replaces the tensor), so a snapshot needs no copy.

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
        self._version = 0
        self.seed(seed, tp_rank)

    @property
    def state(self) -> torch.Tensor:
        """This rank's generator state (a tensor that is replaced, never modified in place)."""
        return self._state

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self._state = value
        self._version += 1

    def snapshot(self) -> tuple[int, torch.Tensor]:
        """The live state and its version: what :meth:`replay` needs to recompute a block later."""
        return self._version, self._state

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
    def replay(self, snapshot: Optional[tuple[int, torch.Tensor]]):
        """Run the block from ``snapshot`` (:meth:`snapshot` before the original forward) when the state
        has moved on since, i.e. when the block is a recomputation in backward; the live state (and its
        version) is restored after. ``None`` or a snapshot of the live state: a first forward, nothing
        changes."""
        live = (self._version, self._state)
        replaying = snapshot is not None and snapshot[0] != self._version
        if replaying:
            self._state = snapshot[1]
        try:
            yield
        finally:  # (a checkpoint may stop a recomputation early by raising)
            if replaying:
                self._version, self._state = live

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
