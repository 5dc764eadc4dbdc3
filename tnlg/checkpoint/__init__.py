"""Checkpoints: crash-safe, exactly resumable, and reshardable across pipeline, TP and DP sizes.

* :func:`save` (collective) writes ``ROOT/iter_0000300/`` through a temporary
  directory renamed only when every rank has finished, then points
  ``ROOT/latest_checkpointed_iteration.txt`` at it (atomic replace). Weights are
  stored per TP rank, the optimizer states (Adam moments, fp32 master) per
  (TP, DP) rank as the flat pieces that rank owns, all streamed one tensor at a
  time into safetensors with the partition sizes, the pieces and every file's
  SHA-256 in ``meta.json`` (a :class:`Manifest`), so any TP size, DP size or ZeRO stage can re-slice
  them (:mod:`.reshard`). RNG states are per rank (:mod:`.rng`). At PP > 1 each pipeline stage
  writes its own parameters, each once, and the manifest names the stage of each (:mod:`.stages`),
  so a load at any pipeline size finds its parameters by name.
* :func:`load` validates (pointer, manifest sizes and checksums, architecture,
  data and tokenizer flags) before it touches anything, then streams weights and
  optimizer pieces into the engine's buffers and restores step count, loss
  scaler and RNG streams: a resumed run (fp32, or bf16 with its fp32 master) logs
  the same losses as an uninterrupted one.
* :func:`inference_plan` and :func:`read_weights` read a checkpoint's weights into a model built at any TP
  size (:func:`tnlg.generation.loading.load_for_inference` builds it).
* The checkpoint builds no model: every function takes the parameters' TP layout (name ->
  :class:`~tnlg.parallel.sharding.ShardSpec`, what :meth:`tnlg.model.GPT.describe` returns) from its caller,
  and ``save``/``load`` ask the model they are given for it (``model.layout()``).
* :class:`StopOnSignal`: Ctrl-C, SIGTERM, SIGHUP -> save, then exit.

Nothing here executes code from a checkpoint: ``meta.json`` is JSON, tensors
are safetensors, RNG files are read with ``torch.load(weights_only=True)``.
"""

from .files import FORMAT, LATEST, has_checkpoint, iter_dir_name, list_iterations, read_latest, read_meta, resolve
from .loading import inference_plan, load, read_states, read_weights
from .manifest import Manifest
from .saving import NonFiniteParameters, save, write_offline
from .signals import StopOnSignal

__all__ = ["save", "load", "inference_plan", "read_weights", "write_offline", "read_states", "has_checkpoint", "Manifest",
           "read_meta", "resolve", "read_latest", "list_iterations", "iter_dir_name", "StopOnSignal",
           "FORMAT", "LATEST", "NonFiniteParameters"]
