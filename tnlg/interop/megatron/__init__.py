"""Megatron-LM GPT checkpoints in and out (docs/megatron.md).

* :func:`megatron_to_checkpoint`: a Megatron-LM checkpoint (``torch_dist`` or legacy per-rank files,
  any TP x PP, megatron-core or legacy names; GPT-2-style models and the Llama family: rope, RMSNorm,
  SwiGLU, grouped-query attention, bias flags; mixtures of experts in either format, any EP) -> a tnlg
  checkpoint (:mod:`.importer`);
* :func:`checkpoint_to_megatron`: a tnlg checkpoint -> a Megatron-LM checkpoint root (:mod:`.exporter`; a
  mixture of experts in ``torch_dist``, or as legacy files with its experts per EP rank, ``SequentialMLP`` or
  ``GroupedMLP`` names).

Modules: :mod:`.safe_load` (unpickling without running code), :mod:`.args` (saved args <->
:class:`~tnlg.config.GPTConfig`), :mod:`.names` (names, QKV, grouped-query and SwiGLU layouts), :mod:`.legacy` and
:mod:`.torch_dist` (the two formats). No collectives: all of it runs in one process.
"""

from .exporter import checkpoint_to_megatron
from .importer import megatron_to_checkpoint

__all__ = ["megatron_to_checkpoint", "checkpoint_to_megatron"]
