"""WikiText-style perplexity with overlapping windows (Megatron's ``tasks/zeroshot_gpt``).

Definitions (Megatron-LM ``tasks/zeroshot_gpt``; docs/eval.md):

* ``T_orig = len(raw.strip().split(" "))`` on the raw file, before any detokenisation;
  ``T_tok`` = number of tokens of the (optionally detokenised) text.
* Windows of ``seq`` input tokens start every ``stride`` tokens. The first window
  scores all its targets; every later window only its last ``stride`` positions
  (fewer in the final, right-padded window), so each of the ``T_tok - 1`` targets
  is scored exactly once.
* ``val_loss = sum / (T_tok - 1)``, ``ppl = exp(min(20, val_loss))``, adjusted
  (word-level) ``ppl = exp(min(20, val_loss * (T_tok - 1) / (T_orig - 1)))``.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

from ..errors import UserError
from .windows import eval_windows, window_loss_sums

__all__ = ["wikitext_detokenizer", "count_original_tokens", "read_wikitext", "eval_windows",
           "wikitext_perplexity", "perplexity_figures", "looks_like_wikitext", "wikitext_caveat", "WORD_COUNT",
           "DETOKENIZERS"]


def wikitext_detokenizer(string: str) -> str:
    """Megatron's WikiText detokeniser (``tasks/zeroshot_gpt/detokenizer.py``), rule for rule."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


DETOKENIZERS = {"none": lambda s: s, "wikitext": wikitext_detokenizer}


def count_original_tokens(raw: str) -> int:
    """``T_orig``: words of the raw text split on single spaces only (Megatron's count;
    WikiText puts spaces around line breaks, so a newline does not separate)."""
    return len(raw.strip().split(" "))


WORD_COUNT = 'T_orig = len(raw.strip().split(" "))'  # what adjusted_ppl divides by (T_orig - 1 words)


def looks_like_wikitext(raw: str) -> bool:
    """Whether a raw file has WikiText's tokenisation: `` = Heading = `` lines and punctuation
    set off by spaces (`` , `` / `` . ``). Only there does ``T_orig`` count words: in ordinary text
    ``split(" ")`` joins the words around every newline, so the adjusted perplexity is meaningless."""
    return bool(re.search(r"^ = [^=\n].* = $", raw, re.M)) and (" , " in raw or " . " in raw)


def wikitext_caveat(path: str, raw: str) -> Optional[str]:
    """The note printed (and put in the JSON) when ``path`` does not look like WikiText; else ``None``."""
    if looks_like_wikitext(raw):
        return None
    return (f"{path!r} does not look like WikiText (no ' = Heading = ' lines with space-separated punctuation): "
            f"adjusted_ppl divides the loss by {WORD_COUNT} - 1, a word count only for WikiText's tokenisation. "
            "For the perplexity of any text use --task text.")


def read_wikitext(path: str, tokenizer, detokenize: str = "none") -> tuple[list[int], int]:
    """Tokens of a raw text file (after the chosen detokeniser) and its ``T_orig``."""
    if detokenize not in DETOKENIZERS:
        raise UserError(f"--detokenize {detokenize!r} is not known; valid: {sorted(DETOKENIZERS)}.")
    raw = check_text_file(path)
    tokens = list(tokenizer.encode(DETOKENIZERS[detokenize](raw)))
    if len(tokens) < 2:
        raise UserError(f"input file {path!r} has {len(tokens)} token(s) after tokenization; perplexity "
                        "needs at least 2 (one target).")
    return tokens, count_original_tokens(raw)


def check_text_file(path: str) -> str:
    """The file's text; a clear error when it is missing, unreadable or holds only whitespace."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"input file {path!r} does not exist; pass a raw text file (e.g. wiki.test.raw "
                        "of WikiText-103).") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read input file {path!r} as UTF-8 text: {err}.") from None
    if not raw.strip():
        raise UserError(f"input file {path!r} is empty (or only whitespace); nothing to evaluate.")
    return raw


def perplexity_figures(total_loss: float, num_tokenized: int, num_original: int) -> dict:
    """``val_loss``, ``ppl`` and the word-level adjusted ``ppl`` from the summed loss."""
    val_loss = total_loss / (num_tokenized - 1)
    out: dict[str, Optional[float]] = {"total_loss": total_loss, "num_tokenized_tokens": num_tokenized, "num_original_tokens": num_original,
           "num_targets": num_tokenized - 1, "val_loss": val_loss, "ppl": math.exp(min(20.0, val_loss))}
    if num_original > 1:
        ratio = (num_tokenized - 1) / (num_original - 1)
        out.update(token_ratio=ratio, adjusted_ppl=math.exp(min(20.0, val_loss * ratio)))
    else:  # one word: the word-level figure is undefined
        out.update(token_ratio=None, adjusted_ppl=None)
    return out


def wikitext_perplexity(model, tokens: Sequence[int], num_original_tokens: int, stride: int = 32,
                        micro_batch_size: int = 8, seq_length: Optional[int] = None, pad_id: int = 0,
                        progress: bool = False) -> dict:
    """Overlapping-window perplexity of ``tokens`` (see the module docstring and
    :func:`tnlg.eval.windows.window_loss_sums` for the collectives). Every rank returns the same dict.
    """
    seq = seq_length or model.config.seq_length
    n = len(tokens)
    if n < 2:
        raise UserError(f"perplexity needs at least 2 tokens, got {n}.")
    (total,), windows = window_loss_sums(model, [tokens], seq, stride, micro_batch_size, pad_id, progress,
                                         "wikitext")
    out = perplexity_figures(total, n, num_original_tokens)
    out.update(seq_length=seq, stride=stride, windows=windows)
    return out
