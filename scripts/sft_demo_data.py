#!/usr/bin/env python
"""Fine-tuning rows built from the built-in corpus: who speaks next in a Shakespeare play.

Each row's prompt is two consecutive speeches of a play with their speakers, then a third speech without its
speaker, and the question; the completion is the third speech's speaker::

    {"prompt": "Nurse.\\nPeace, I have done. ...\\n\\nLady Capulet.\\nMarry, ...\\n\\nJuliet?\\n...", ...}

    prompt:      <speaker A>.\\n<speech>\\n\\n<speaker B>.\\n<speech>\\n\\n<speech>\\nWho speaks?
    completion:  "<speaker C>"

Scored by exact match after SQuAD's normalisation and ROUGE (``tnlg eval --task generate``). The train rows come
from the works ``tnlg pretrain``'s built-in job trains on (its first 44), the valid and test rows from the five
it holds out (``--split 90,10,0``): speakers the model has never seen, so only what it learned of dialogue
(who answered whom) carries over. Rows are kept within ``--max-chars`` (the built-in model reads 128 tokens).

    python scripts/sft_demo_data.py --out data/speakers       # train.jsonl, valid.jsonl, test.jsonl
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


def rows_of(text: str, max_chars: int) -> list[dict]:
    sp = speeches(text)
    out = []
    for (a, sa), (b, sb), (c, sc) in zip(sp, sp[1:], sp[2:]):
        prompt = f"{a}.\n{sa}\n\n{b}.\n{sb}\n\n{sc}\nWho speaks?"
        if len(prompt) <= max_chars:
            out.append(dict(prompt=prompt, completion=c))  # (no leading space: SentencePiece adds its own)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for train.jsonl, valid.jsonl and test.jsonl")
    p.add_argument("--max-chars", type=int, default=320)
    p.add_argument("--train", type=int, default=4000, help="train rows (default 4000)")
    p.add_argument("--eval", type=int, default=100, help="valid and test rows each (default 100)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from tnlg.data.corpus import corpus_documents
    works = [body for name, body in corpus_documents()]
    seen = [r for body in works[:-HELD_OUT] for r in rows_of(body, args.max_chars)]
    held = [r for body in works[-HELD_OUT:] for r in rows_of(body, args.max_chars)]
    rng = random.Random(args.seed)
    rng.shuffle(seen)
    rng.shuffle(held)
    os.makedirs(args.out, exist_ok=True)
    splits = dict(train=seen[:args.train], valid=held[:args.eval], test=held[args.eval:2 * args.eval])
    for name, rows in splits.items():
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{name}: {len(rows)} rows -> {os.path.join(args.out, name + '.jsonl')}")
    return 0


if __name__ == "__main__":
    _bench.run(main)
