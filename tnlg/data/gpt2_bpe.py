"""Training a GPT-2-style byte-level BPE tokenizer (``tnlg train-tokenizer --model-type gpt2-bpe``).

GPT-2's scheme (Radford et al. 2019), as the `tokenizers` library implements it: text is
pre-split by GPT-2's regex, each piece's UTF-8 bytes are mapped to 256 printable symbols
(``Ġ`` is the space byte), and merges are learned over those symbols, most frequent pair first.
No prefix space, no normalisation, no unknown token (every byte is a symbol), so
``decode(encode(text)) == text`` for every string. ``<|endoftext|>`` (the end-of-document token)
is the last id, as in GPT-2's own ``vocab.json`` (50256 of 50257).

Writes ``vocab.json`` + ``merges.txt`` (GPT-2's file formats: ``{"token": id}`` and
``#version: 0.2`` then one merge ``left right`` per line, in rank order) into a folder, which
:func:`tnlg.data.tokenizer.load_tokenizer`, ``tnlg preprocess --tokenizer-model FOLDER`` and
Hugging Face's ``GPT2TokenizerFast.from_pretrained(FOLDER)`` all read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence, Union

from ..errors import UserError
from ..io import atomic_write
from .inputs import check_inputs, iter_documents

__all__ = ["train_gpt2_bpe", "MIN_VOCAB_SIZE"]

EOD_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 258  # the 256 byte symbols, at least one merge, <|endoftext|>


def train_gpt2_bpe(inputs: Sequence[Union[str, Path]], vocab_size: int, output_dir: Union[str, Path],
                   json_keys: Sequence[str] = ("text",), min_frequency: int = 2) -> str:
    """Train a byte-level BPE of ``vocab_size`` ids (256 bytes + merges + ``<|endoftext|>``) on the
    documents of ``inputs`` (read as :mod:`tnlg.data.inputs` reads them) and write
    ``output_dir/vocab.json`` + ``merges.txt``; returns the folder. Fewer ids result when the text
    has fewer pairs seen ``min_frequency`` times. Files are written under temporary names, then renamed.
    """
    from .tokenizer import _import_tokenizers
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"--vocab-size must be an integer >= {MIN_VOCAB_SIZE} for gpt2-bpe (256 byte symbols, "
                        f"at least one merge and <|endoftext|>), got {vocab_size!r}.")
    check_inputs(inputs, json_keys)
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-prefix {str(out)!r} is a file; gpt2-bpe writes vocab.json + merges.txt into a "
                        "folder: name a new or existing folder.")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator((text for _, _, text in iter_documents(inputs, json_keys)), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    vocab[EOD_TOKEN] = len(vocab)  # never learned: GPT-2's regex splits it into "<|", "endoftext", "|>"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    os.makedirs(out, exist_ok=True)
    atomic_write(str(out / "vocab.json"), json.dumps(vocab, ensure_ascii=False).encode("utf-8"), durable=False)
    atomic_write(str(out / "merges.txt"), ("#version: 0.2\n" + "".join(f"{m}\n" for m in merges)).encode("utf-8"),
                 durable=False)
    return str(out)
