"""Scores of generated text against references: ROUGE-1, ROUGE-2, ROUGE-L F-measure and SQuAD's exact
match and token F1 (pure Python, no dependency; the formulas are in docs/eval.md).

* ROUGE reproduces ``rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=...)``
  exactly: its tokenizer (lower-case, every run of characters outside ``[a-z0-9]`` a separator, so accented
  and other non-ASCII letters separate words too; with ``use_stemmer`` the tokens longer than 3 characters
  through nltk's Porter stemmer, reproduced by :mod:`.porter`), n-gram overlap with counts clipped by the
  reference's, ROUGE-L from the longest common subsequence of the two token lists; ``P``, ``R`` and
  ``F = 2PR / (P + R)`` (0 when ``P + R = 0``) computed in the same order, so the floats are equal.
  Several references: per ROUGE type the best F over them (``RougeScorer.score_multi``).
* Exact match and token F1 are the official SQuAD v1.1 script's (``normalize_answer``: lower-case, drop
  ``string.punctuation``, drop the words a/an/the, collapse whitespace; F1 from the multiset of common
  tokens, 0 when none is shared, empty against empty included); several references: the best of each.

Scores are fractions in [0, 1]; a data set's figure is the plain mean over its examples.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache
from typing import Sequence, Union

from .porter import porter_stem

__all__ = ["ROUGE_TYPES", "rouge_tokens", "rouge_f", "normalize_answer", "exact_match", "token_f1",
           "score_example", "mean_scores", "SCORE_KEYS"]

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
SCORE_KEYS = ROUGE_TYPES + ("exact_match", "f1")

_NON_ALPHANUMERIC = re.compile(r"[^a-z0-9]+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)

References = Union[str, Sequence[str]]


_stem = lru_cache(maxsize=1 << 16)(porter_stem)


def rouge_tokens(text: str, use_stemmer: bool = False) -> list[str]:
    """``rouge_score``'s tokens of ``text``: lower-cased, split at every run of characters other than ``a-z``
    and ``0-9``; with ``use_stemmer`` each token longer than 3 characters Porter-stemmed; empty ones dropped."""
    tokens = _NON_ALPHANUMERIC.sub(" ", text.lower()).split()
    if use_stemmer:
        tokens = [t for t in (_stem(t) if len(t) > 3 else t for t in tokens) if t]
    return tokens


def _f_measure(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def _ngram_f(reference: list[str], prediction: list[str], n: int) -> float:
    ref = Counter(tuple(reference[i:i + n]) for i in range(len(reference) - n + 1))
    pred = Counter(tuple(prediction[i:i + n]) for i in range(len(prediction) - n + 1))
    overlap = sum(min(count, pred[gram]) for gram, count in ref.items())
    return _f_measure(overlap / max(sum(pred.values()), 1), overlap / max(sum(ref.values()), 1))


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row at a time)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, 1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(above, row[j - 1])
            diagonal = above
    return row[-1]


def _lcs_f(reference: list[str], prediction: list[str]) -> float:
    if not reference or not prediction:
        return 0.0
    lcs = _lcs_length(reference, prediction)
    return _f_measure(lcs / len(prediction), lcs / len(reference))


def _as_list(references: References) -> list[str]:
    return [references] if isinstance(references, str) else list(references)


def rouge_f(references: References, prediction: str, use_stemmer: bool = False) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F-measure of ``prediction``; with several references the best of each."""
    pred = rouge_tokens(prediction, use_stemmer)
    best = dict.fromkeys(ROUGE_TYPES, 0.0)
    for i, reference in enumerate(_as_list(references)):
        ref = rouge_tokens(reference, use_stemmer)
        scores = {"rouge1": _ngram_f(ref, pred, 1), "rouge2": _ngram_f(ref, pred, 2), "rougeL": _lcs_f(ref, pred)}
        best = scores if i == 0 else {k: max(best[k], scores[k]) for k in ROUGE_TYPES}
    return best


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lower-case, punctuation removed, articles removed, whitespace
    collapsed (in that order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(references: References, prediction: str) -> float:
    """1.0 when the normalised prediction equals a normalised reference, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(r) == pred for r in _as_list(references)))


def _f1(reference: str, prediction: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def token_f1(references: References, prediction: str) -> float:
    """SQuAD v1.1's token F1 of the normalised strings; with several references the best."""
    return max(_f1(r, prediction) for r in _as_list(references))


def score_example(references: References, prediction: str, use_stemmer: bool = False) -> dict[str, float]:
    """Every score of one example (:data:`SCORE_KEYS`); ``use_stemmer`` for ROUGE only."""
    if not _as_list(references):
        raise ValueError("an example needs at least one reference")
    return {**rouge_f(references, prediction, use_stemmer), "exact_match": exact_match(references, prediction),
            "f1": token_f1(references, prediction)}


def mean_scores(per_example: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each score over the examples (:data:`SCORE_KEYS`)."""
    if not per_example:
        raise ValueError("no examples to average")
    return {k: sum(s[k] for s in per_example) / len(per_example) for k in SCORE_KEYS}
