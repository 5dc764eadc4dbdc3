"""Text generation from a tnlg model at any TP x PP: greedy, temperature, top-k, top-p, with a KV cache.

Modules: :mod:`.generator` (:func:`generate`, :func:`generate_tokens`, :func:`generate_ids`: batching and
the decoding loop), :mod:`.options` (:class:`SamplingOptions`), :mod:`.steps` (the prefill of right-padded
prompts, each row at its own length in the KV cache, a decode step of one token per row, the choice of the
next ids), :mod:`.sampling` (one seeded draw per prompt from the candidates), :mod:`.loading`
(a model and its tokenizer from a Hugging Face folder or a tnlg checkpoint, for evaluation too).
The vocabulary-parallel top-k and argmax are collectives of :mod:`tnlg.parallel.vocab`; the
``tnlg generate`` command is :mod:`tnlg.commands.generate`.
"""

from .generator import check_prompts, continuation_text, generate, generate_ids, generate_tokens
from .options import SamplingOptions, check_sampling

__all__ = ["generate", "generate_tokens", "generate_ids", "SamplingOptions", "continuation_text", "check_prompts",
           "check_sampling"]
