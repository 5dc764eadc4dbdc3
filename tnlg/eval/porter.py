"""The Porter stemmer as ``rouge_score`` uses it: nltk's ``PorterStemmer()`` in its default mode
(``NLTK_EXTENSIONS``), reproduced without nltk (docs/eval.md).

Porter, "An algorithm for suffix stripping" (1980), steps 1a to 5b, with nltk's departures from the paper:
a pool of irregular forms (``skies`` -> ``sky``, ``dying`` -> ``die``, ...), words of at most two letters
left alone, ``ies``/``ied`` of four-letter words kept as ``ie``, ``ied`` -> ``i`` before step 1b's rules,
``y`` -> ``i`` only after a consonant that is not the whole stem, the two-letter ``vc`` stem counting as
``*o``, ``bli`` -> ``ble`` (instead of ``abli`` -> ``able``), ``alli`` -> ``al`` then step 2 again, and the
extra step-2 rules ``fulli`` -> ``ful`` and ``logi`` -> ``log``. A rule list applies its first rule whose
suffix matches; when that rule's condition fails the word is left as it is.

``rouge_score`` stems only tokens longer than 3 characters (its tokens are ``[a-z0-9]+``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

__all__ = ["porter_stem"]

_VOWELS = frozenset("aeiou")
_IRREGULAR = {"sky": ["sky", "skies"], "die": ["dying"], "lie": ["lying"], "tie": ["tying"], "news": ["news"],
              "inning": ["innings", "inning"], "outing": ["outings", "outing"], "canning": ["cannings", "canning"],
              "howe": ["howe"], "proceed": ["proceed"], "exceed": ["exceed"], "succeed": ["succeed"]}
_POOL = {form: stem for stem, forms in _IRREGULAR.items() for form in forms}

Rule = tuple[str, str, Optional[Callable[[str], bool]]]


def _consonants(word: str) -> list[bool]:
    """Per letter: a consonant? (a letter other than a, e, i, o, u, and other than a y after a consonant)."""
    flags: list[bool] = []
    for i, ch in enumerate(word):
        flags.append(ch not in _VOWELS if ch != "y" else (i == 0 or not flags[i - 1]))
    return flags


def _measure(stem: str) -> int:
    """m of ``[C](VC){m}[V]``: the number of vowel-to-consonant changes."""
    flags = _consonants(stem)
    return sum(1 for a, b in zip(flags, flags[1:]) if not a and b)


def _positive(stem: str) -> bool:
    return _measure(stem) > 0


def _has_vowel(stem: str) -> bool:
    return not all(_consonants(stem))


def _double_consonant(word: str) -> bool:
    return len(word) >= 2 and word[-1] == word[-2] and _consonants(word)[-1]


def _cvc(word: str) -> bool:
    """``*o``: ends consonant-vowel-consonant, the last not w, x or y (nltk: or the whole word is vowel-consonant)."""
    flags = _consonants(word)
    if len(word) >= 3 and flags[-3] and not flags[-2] and flags[-1] and word[-1] not in "wxy":
        return True
    return len(word) == 2 and not flags[0] and flags[1]


def _apply(word: str, rules: Sequence[Rule]) -> str:
    """The first rule whose suffix ends ``word`` (``*d``: a double consonant) decides."""
    for suffix, replacement, condition in rules:
        if suffix == "*d" and _double_consonant(word):
            stem = word[:-2]
        elif word.endswith(suffix):
            stem = word[:len(word) - len(suffix)]
        else:
            continue
        return stem + replacement if condition is None or condition(stem) else word
    return word


def _step1a(word: str) -> str:
    if word.endswith("ies") and len(word) == 4:
        return word[:-3] + "ie"
    return _apply(word, [("sses", "ss", None), ("ies", "i", None), ("ss", "ss", None), ("s", "", None)])


def _step1b(word: str) -> str:
    if word.endswith("ied"):
        return word[:-3] + ("ie" if len(word) == 4 else "i")
    if word.endswith("eed"):
        return word[:-3] + "ee" if _measure(word[:-3]) > 0 else word
    for suffix in ("ed", "ing"):
        if word.endswith(suffix) and _has_vowel(word[:-len(suffix)]):
            stem = word[:-len(suffix)]
            break
    else:
        return word
    return _apply(stem, [("at", "ate", None), ("bl", "ble", None), ("iz", "ize", None),
                         ("*d", stem[-1], lambda _: stem[-1] not in "lsz"),
                         ("", "e", lambda s: _measure(s) == 1 and _cvc(s))])


def _step1c(word: str) -> str:
    return _apply(word, [("y", "i", lambda s: len(s) > 1 and _consonants(s)[-1])])


_STEP2 = [("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"), ("izer", "ize"),
          ("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous"), ("ization", "ize"),
          ("ation", "ate"), ("ator", "ate"), ("alism", "al"), ("iveness", "ive"), ("fulness", "ful"),
          ("ousness", "ous"), ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"), ("fulli", "ful")]


def _step2(word: str) -> str:
    if word.endswith("alli") and _positive(word[:-4]):
        return _step2(word[:-4] + "al")
    rules: list[Rule] = [(s, r, _positive) for s, r in _STEP2]
    rules.append(("logi", "log", lambda _: _positive(word[:-3])))
    return _apply(word, rules)


def _step3(word: str) -> str:
    return _apply(word, [(s, r, _positive) for s, r in (("icate", "ic"), ("ative", ""), ("alize", "al"),
                                                          ("iciti", "ic"), ("ical", "ic"), ("ful", ""),
                                                          ("ness", ""))])


def _step4(word: str) -> str:
    def above_one(stem: str) -> bool:
        return _measure(stem) > 1

    rules: list[Rule] = [(s, "", above_one) for s in ("al", "ance", "ence", "er", "ic", "able", "ible", "ant",
                                                      "ement", "ment", "ent")]
    rules.append(("ion", "", lambda s: _measure(s) > 1 and s[-1:] in ("s", "t")))
    rules += [(s, "", above_one) for s in ("ou", "ism", "ate", "iti", "ous", "ive", "ize")]
    return _apply(word, rules)


def _step5(word: str) -> str:
    if word.endswith("e"):
        m = _measure(word[:-1])
        if m > 1 or (m == 1 and not _cvc(word[:-1])):
            word = word[:-1]
    return _apply(word, [("ll", "l", lambda _: _measure(word[:-1]) > 1)])


def porter_stem(word: str) -> str:
    """nltk's ``PorterStemmer().stem(word)`` (lower-cased first)."""
    stem = word.lower()
    if stem in _POOL:
        return _POOL[stem]
    if len(word) <= 2:
        return stem
    for step in (_step1a, _step1b, _step1c, _step2, _step3, _step4, _step5):
        stem = step(stem)
    return stem
