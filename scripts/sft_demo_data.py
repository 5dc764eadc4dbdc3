#!/usr/bin/env python
"""Fine-tuning rows built from the built-in corpus: which Shakespeare play two speeches come from (or who speaks).

``--task play`` (the default): the prompt is two consecutive speeches of a play with their speakers and the
question, the completion the play's title::

    prompt:      <speaker A>.\\n<speech>\\n\\n<speaker B>.\\n<speech>\\n\\nWhich play?
    completion:  "Romeo and Juliet"

``--task speaker``: a third speech follows without its speaker, the question is ``Who speaks?`` and the
completion that speaker.

Scored by exact match after SQuAD's normalisation and ROUGE (``tnlg eval --task generate``). The rows come from
the works ``tnlg pretrain``'s built-in job trains on (its first 44), split at random into train, valid and test
(disjoint rows of the same plays: the base model has read these passages, never the question); with
``--held-out`` the valid and test rows come from the five works it holds out (``--split 90,10,0``): speakers it
has never seen. Rows are kept within ``--max-chars`` (the built-in model reads 128 tokens).

    python scripts/sft_demo_data.py --out data/plays       # train.jsonl, valid.jsonl, test.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

import _bench

_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,28}\.$")
HELD_OUT = 5  # the built-in job validates on the corpus's last five works (--split 90,10,0)


def speeches(text: str) -> list[tuple[str, str]]:
    """``(speaker, speech)`` of every block that opens with a speaker's line (``Juliet.``)."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and _SPEAKER.match(lines[0].strip()):
            out.append((lines[0].strip()[:-1], "\n".join(line.strip() for line in lines[1:])))
    return out


def rows_of(text: str, max_chars: int, task: str, title: str) -> list[dict]:
    sp = speeches(text)
    out = []
    for (a, sa), (b, sb), (c, sc) in zip(sp, sp[1:], sp[2:]):
        if task == "speaker":
            prompt, answer = f"{a}.\n{sa}\n\n{b}.\n{sb}\n\n{sc}\nWho speaks?", c
        else:
            prompt, answer = f"{a}.\n{sa}\n\n{b}.\n{sb}\n\nWhich play?", title
        if len(prompt) <= max_chars:
            out.append(dict(prompt=prompt, completion=answer))  # (no leading space: SentencePiece adds its own)
    return out


def title_of(name: str) -> str:
    """``shksprdata/texts/romeo_and_juliet_gut.txt`` -> ``Romeo and Juliet``."""
    words = os.path.basename(name).removesuffix("_gut.txt").split("_")
    roman = ("i", "ii", "iii", "iv", "v", "vi", "viii")
    return " ".join(w.upper() if w in roman else w if i and w in ("and", "of", "the") else w.capitalize()
                    for i, w in enumerate(words))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for train.jsonl, valid.jsonl and test.jsonl")
    p.add_argument("--max-chars", type=int, default=320)
    p.add_argument("--train", type=int, default=4000, help="train rows (default 4000)")
    p.add_argument("--eval", type=int, default=100, help="valid and test rows each (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=["play", "speaker"], default="play",
                   help="play: which play two speeches come from (default); speaker: who speaks a third speech")
    p.add_argument("--held-out", action="store_true", help="valid and test rows from the five held-out works")
    args = p.parse_args()
    from tnlg.data.corpus import corpus_documents
    works = [(title_of(name), body) for name, body in corpus_documents()]
    seen = [r for title, body in works[:-HELD_OUT] for r in rows_of(body, args.max_chars, args.task, title)]
    rng = random.Random(args.seed)
    rng.shuffle(seen)
    if args.held_out:
        held = [r for title, body in works[-HELD_OUT:] for r in rows_of(body, args.max_chars, args.task, title)]
        rng.shuffle(held)
    else:
        seen, held = seen[2 * args.eval:], seen[:2 * args.eval]
    os.makedirs(args.out, exist_ok=True)
    splits = dict(train=seen[:args.train], valid=held[:args.eval], test=held[args.eval:2 * args.eval])
    for name, rows in splits.items():
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{name}: {len(rows)} rows -> {os.path.join(args.out, name + '.jsonl')}")
    return 0


if __name__ == "__main__":
    _bench.run(main)
