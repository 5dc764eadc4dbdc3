"""tnlg: Megatron-style tensor parallelism composed with ZeRO data parallelism, for GPT pretraining."""

from .config import GPTConfig, partition_sizes
from .model import GPT, KVCache, gather_logits, parameter_counts
from .generate import generate, generate_ids
from .parallel import (ColumnParallelLinear, ParallelState, RowParallelLinear, VocabParallelEmbedding,
                       destroy_parallel, init_parallel, vocab_parallel_cross_entropy)

__version__ = "0.1.0"

__all__ = ["GPTConfig", "GPT", "KVCache", "ParallelState", "init_parallel", "destroy_parallel",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "gather_logits", "parameter_counts", "partition_sizes",
           "generate", "generate_ids"]
