"""The GPT-2 decoder (and the Llama family), tensor-parallel (Megatron paper, section 3), nanoGPT-style names.

**The activation layout** is one, Megatron's: sequence-first ``[s, b, h]`` inside the decoder, from the
embedding (which looks up the transposed tokens) through every block to the head, whose logits are
``[s, b, V_pad / tp]``; the loss reads the labels transposed, and the logits leave the decoder batch-first
``[b, s, V_pad / tp]`` (a transposed view) where it hands them out (:mod:`.forward`).

Per transformer block and per pass, TP communication is two all-reduces of an
``[s, b, h]`` tensor (one after attention, one after the MLP) in
forward and two in backward (the ``f`` operators at the input of each half).
The embedding adds one all-reduce, the LM head one in backward, and the
vocab-parallel cross-entropy three small ``[s, b]`` all-reduces.

Attention heads are split over TP ranks as evenly as possible (sizes differ by
at most one, :func:`tnlg.config.partition_sizes`), so 28 heads run at TP=8 or
16, which Megatron refuses. The fused QKV weight is laid out per head
(rows ``[head][q, k, v][head_dim]``), so a contiguous row split gives each rank
whole heads. The MLP width is split the same way; the vocabulary is padded to a
multiple of ``128 * tp`` (as Megatron) and the padded logits are masked. The LM head is the
word embedding (tied, GPT-2), or with ``config.untie_embeddings_and_output_weights`` its own
weight ``lm_head.weight`` split the same way (Megatron's untied ``output_layer``); the MLP's
GELU is the tanh form, or the exact one with ``config.openai_gelu=False`` (Megatron's default).

Initialisation is TP-invariant: every layer draws its parameters in full from a CPU
generator seeded by ``(config.seed, parameter name)`` and then slices them
(:mod:`tnlg.parallel.initialization`), so a shard is exactly the matching slice of the
TP=1 weight. Weights are ``N(0, init_method_std^2)``, the residual projections
(``c_proj``) ``N(0, init_method_std^2 / (2 L))`` (GPT-2 / Megatron scaled init);
biases zeros, LayerNorm weights ones.

Sequence parallelism (``config.sequence_parallel``, Korthikanti et al. 2022; docs/sequence_parallel.md):
between the TP regions the activations are this rank's positions of the sequence,
``[s_r, b, h]`` in the same sequence-first layout (so the collectives split along dim 0 with no
transposed copies; :func:`tnlg.parallel.mappings.sequence_sizes`, uneven when TP does not divide
``s``), so LayerNorm, dropout and the residual adds run on ``1/t`` of the tokens.
Per block and pass the two all-reduces become two all-gathers (before QKV and fc) and two
reduce-scatters (after the output projections) in forward, and the reverse in backward,
plus one more all-gather per column layer in backward (only the shard of its input is
stored). The embedding reduce-scatters instead of all-reducing, the LM head all-gathers
``ln_f``'s output. Replicated parameters applied to a sequence shard must end with the
gradient over the whole sequence on every TP rank: a block's LayerNorm weights and biases
and row-parallel biases enter through one coalesced ``f`` (one small all-reduce of their
six gradients together in backward; ``ln_f`` has its own), and the position embedding is
added inside the embedding's reduce-scatter, whose backward all-gather already gives it
the whole gradient. Incremental
decoding (``kv_cache``), ``last_only`` and sequences shorter than TP run without it, and
``model.sequence_parallel = False`` turns it off (the results are the same either way).

Recomputation (``config.recompute_granularity``): ``"full"`` checkpoints every block
(only its input is kept; the block runs again in backward), ``"selective"`` only the
attention core (softmax and dropout over ``a s^2``, Korthikanti et al. section 5).

**The modules.** :mod:`.decoder` (:class:`GPT`, the whole decoder, and :class:`DecoderBase`, whose
:meth:`~DecoderBase.run` is the one forward: embedding when it holds the first layer, blocks, head when it
holds the last), :mod:`.stage` (a pipeline rank's part of it, :class:`StageModel`, and the chunk a schedule
runs), :mod:`.spec` (each layer's :class:`~.slots.BlockSpec`, chosen from the config in one place: the attention
core and the MLP are slots), :mod:`.block`, :mod:`.attention` (with its core from the spec: SDPA locally, the
ring under context parallelism, each applying the layer's window; their masks: :mod:`tnlg.parallel.masks`), :mod:`.kv_cache` (per-row lengths), :mod:`.kv_cache` (keys and values of past positions, a length per row),
:mod:`.norms`, :mod:`.forward` (what one forward's layers
share: the sequence split, rope's angles, the mask, the KV cache), :mod:`.inference` (forward-only passes
through a pipeline's stages). The loss is outside the model's layers: :mod:`tnlg.parallel.loss`.
"""

from .attention import LocalAttention, ParallelAttention
from .block import Block, ParallelMLP, _dropout
from .decoder import GPT, DecoderBase
from .forward import ForwardContext
from .kv_cache import KVCache, local_kv_heads
from .norms import LayerNorm, RMSNorm, make_norm, norm_parameters
from .stage import PipelineChunk, StageModel
from ..parallel.vocab import gather_logits

__all__ = ["DecoderBase", "GPT", "KVCache", "StageModel", "PipelineChunk", "Block", "ParallelAttention",
           "ParallelMLP", "LocalAttention", "ForwardContext", "LayerNorm", "RMSNorm", "make_norm", "norm_parameters",
           "local_kv_heads", "gather_logits", "_dropout"]  # gather_logits: defined in parallel.vocab
