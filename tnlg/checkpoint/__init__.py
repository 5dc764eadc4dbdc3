"""Checkpoints: crash-safe, exactly resumable, and reshardable across TP and DP sizes.

* :func:`save` (collective) writes ``ROOT/iter_0000300/`` through a temporary
  directory renamed only when every rank has finished, then points
  ``ROOT/latest_checkpointed_iteration.txt`` at it (atomic replace). Weights and
  Adam moments are stored per TP rank as safetensors with the partition sizes
  in ``meta.json``, so any TP size can re-slice them (:mod:`.reshard`); the
  optimizer state is per parameter, so any DP size / ZeRO stage can
  re-partition it. RNG states are per rank (:mod:`.rng`).
* :func:`load` validates (pointer, manifest sizes, architecture, data and
  tokenizer flags) before it touches anything, then restores weights, optimizer,
  step count, loss scaler and RNG streams: a resumed fp32 run logs the same
  losses as an uninterrupted one.
* :func:`load_for_inference` builds a :class:`tnlg.GPT` at any TP size from a checkpoint.
* :class:`StopOnSignal`: SIGTERM -> save, then exit.

Nothing here executes code from a checkpoint: ``meta.json`` is JSON, tensors
are safetensors, RNG files are read with ``torch.load(weights_only=True)``.
"""

from .files import FORMAT, LATEST, has_checkpoint, iter_dir_name, list_iterations, read_latest, read_meta, resolve
from .loading import load, load_for_inference, read_states
from .saving import save, write_checkpoint
from .signals import StopOnSignal

__all__ = ["save", "load", "load_for_inference", "write_checkpoint", "read_states", "has_checkpoint",
           "read_meta", "resolve", "read_latest", "list_iterations", "iter_dir_name", "StopOnSignal",
           "FORMAT", "LATEST"]
