"""Zero-shot evaluation as Megatron defines it: WikiText perplexity, LAMBADA accuracy, dataset loss;
the perplexity of any text files; generation scored with ROUGE, exact match and token F1.

Modules: :mod:`.windows` (overlapping-window scoring of token streams), :mod:`.wikitext`
(WikiText perplexity, the WikiText detokeniser), :mod:`.text` (token-weighted perplexity of text files),
:mod:`.lambada` (strict / non-strict last-word accuracy), :mod:`.loss` (loss over a
``.bin/.idx`` dataset), :mod:`.batches` (the loop they share); for ``--task generate``
:mod:`.completion_rows` (the prompt/completion rows), :mod:`.predictions` (greedy predictions and their
scores), :mod:`.scoring` (ROUGE, exact match, token F1) and :mod:`.porter` (rouge_score's stemmer).
Models and tokenizers come from :mod:`tnlg.generation.loading`; the ``tnlg eval`` command is :mod:`tnlg.commands.eval`.
"""

from .lambada import lambada_accuracy, lambada_examples, read_lambada_texts, split_last_word
from .loss import build_eval_dataset, dataset_loss
from .text import read_text_files, text_perplexity
from .wikitext import count_original_tokens, eval_windows, read_wikitext, wikitext_detokenizer, wikitext_perplexity

__all__ = ["wikitext_perplexity", "wikitext_detokenizer", "read_wikitext", "count_original_tokens", "eval_windows",
           "lambada_accuracy", "lambada_examples", "read_lambada_texts", "split_last_word",
           "dataset_loss", "build_eval_dataset", "text_perplexity", "read_text_files"]
