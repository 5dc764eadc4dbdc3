"""Deprecated home of :func:`vocab_parallel_cross_entropy`: it lives in :mod:`tnlg.parallel.vocab`
with the other operations on vocabulary-parallel logits."""

from .vocab import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]
