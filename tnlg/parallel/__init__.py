"""Tensor-parallel building blocks: state, autograd collectives, layers, cross-entropy, RNG."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (copy_to_tp, gather_from_sequence_parallel, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sequence_parallel, scatter_to_sequence_parallel, scatter_to_tp)
from .random import TPRandom
from .state import ParallelState, destroy_parallel, init_parallel

__all__ = ["ParallelState", "init_parallel", "destroy_parallel", "copy_to_tp", "reduce_from_tp",
           "scatter_to_tp", "gather_from_tp", "gather_from_sequence_parallel",
           "reduce_scatter_to_sequence_parallel", "scatter_to_sequence_parallel", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "TPRandom"]
