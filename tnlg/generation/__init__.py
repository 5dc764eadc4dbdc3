"""Text generation from a tnlg model at any TP x PP: greedy, temperature, top-k, top-p, with a KV cache.

Modules: :mod:`.generator` (:func:`generate`, :func:`generate_ids`: batching, left padding, the
decoding loop), :mod:`.sampling` (one seeded draw per prompt from the candidates), :mod:`.loading`
(a model and its tokenizer from a Hugging Face folder or a tnlg checkpoint, for evaluation too).
The vocabulary-parallel top-k and argmax are collectives of :mod:`tnlg.parallel.vocab`; the
``tnlg generate`` command is :mod:`tnlg.commands.generate`.
"""

from .generator import check_prompts, check_sampling, continuation_text, generate, generate_ids

__all__ = ["generate", "generate_ids", "continuation_text", "check_prompts", "check_sampling"]
