"""Tensor-parallel building blocks: state, autograd collectives, layers, sharding metadata and
initialisation, vocabulary-parallel operations (cross-entropy, gather, top-k), RNG."""

from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (copy_to_tp, gather_from_sequence_parallel, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sequence_parallel, scatter_to_sequence_parallel, scatter_to_tp)
from .random import TPRandom
from .state import ParallelState, destroy_parallel, init_parallel
from .vocab import gather_logits, vocab_parallel_cross_entropy

__all__ = ["ParallelState", "init_parallel", "destroy_parallel", "copy_to_tp", "reduce_from_tp",
           "scatter_to_tp", "gather_from_tp", "gather_from_sequence_parallel",
           "reduce_scatter_to_sequence_parallel", "scatter_to_sequence_parallel", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "gather_logits", "TPRandom"]
