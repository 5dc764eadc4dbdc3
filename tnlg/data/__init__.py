"""Tokenized corpora: tokenizers, Megatron's .bin/.idx format, preprocessing, the GPT dataset.

Modules: :mod:`~tnlg.data.tokenizer` (SentencePiece, GPT-2 BPE, training),
:mod:`~tnlg.data.indexed` (``IndexedDataset``/``IndexedDatasetBuilder``),
:mod:`~tnlg.data.preprocess` (text -> .bin/.idx), :mod:`~tnlg.data.gpt_dataset`
(samples, splits, blending, cached indices), :mod:`~tnlg.data.sampler`
(data-parallel micro batches), :mod:`~tnlg.data.corpus` (the built-in corpus),
:mod:`~tnlg.data.inputs` (reading .jsonl/.txt inputs), :mod:`~tnlg.data.rows` (the one reader of JSON Lines,
Parquet and ``datasets`` rows, and its error format), :mod:`~tnlg.data.sft` (fine-tuning rows
packed into sequences; rows in :mod:`~tnlg.data.sft_rows`, chat templates in :mod:`~tnlg.data.chat`), :mod:`~tnlg.data.paths` (where the
shipped files and the cache live) and :mod:`~tnlg.commands.data` (the data subcommands).
Imports flow one way: tables <- rows <- inputs, sft_rows; paths, inputs, indexed <- tokenizer <- preprocess <-
corpus <- cli;
gpt_dataset <- indexed, paths.
The names below are imported on first use, so ``import tnlg.data`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer", "train_sentencepiece": "tokenizer",
    "IndexedDataset": "indexed", "IndexedDatasetBuilder": "indexed",
    "GPTDataset": "gpt_dataset", "BlendedDataset": "gpt_dataset",
    "build_train_valid_test_datasets": "gpt_dataset",
    "MegatronPretrainingSampler": "sampler", "Batch": "batch",
    "default_dataset": "corpus",
    "build_sft_datasets": "sft", "SFTReport": "sft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'tnlg.data' has no attribute {name!r}")
