"""Fine-tuning data: rows -> token samples with a loss mask -> sequences packed without cross-sample
attention (docs/finetune.md).

**A sample** is token ids and, per token, whether it is *counted* as a target. Prompt/completion: the
tokenizer's ids of the prompt, then of the completion, then the end-of-document id, each text encoded
on its own exactly as ``tnlg preprocess`` encodes a document (``Tokenizer.encode_batch``, no BOS); the
completion's tokens and the end-of-document id are counted (every token with ``loss_on_prompt``).
``messages``: the segments of :mod:`tnlg.data.chat`: the built-in template's texts each encoded on its
own; a folder template's stretches between added tokens each encoded whole, a token counted when it covers
a counted character, and its special tokens their single ids.

**Lengths.** A sequence holds ``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``). A longer
sample is cut to its first ``seq_length + 1`` tokens (*truncated*); one with no counted target left
after the cut (its prompt fills the sequence) is *skipped*; both are counted in :class:`SFTReport`.

**Packing** (greedy first fit, in the rows' order): each sample goes into the first sequence with room
for all its tokens (samples are never split); a sequence holds samples whose lengths sum to at most
``seq_length + 1``. Without packing each sample is a sequence of its own. The rest of a sequence is
padding (the end-of-document id).

**An item** (:meth:`SFTDataset.__getitem__`), as ``GPTDataset``'s with ``--reset-position-ids
--reset-attention-mask``: ``tokens``/``labels`` (the stream shifted by one), ``loss_mask`` 1 where the
label is a counted token of the same sample (so a sample's last token never predicts the next sample's
first, and padding never counts), ``position_ids`` restarting at 0 at each sample (and at the padding),
``attention_mask`` the document id of each position ``[s]`` (int64: where its sample, or the padding, starts,
as :func:`tnlg.parallel.context.document_ids` reads a mask): each sample and the padding is its own block of the block-causal mask attention builds
from them (:func:`tnlg.parallel.masks.document_mask`). So a packed sample's logits are those of the sample
alone, and an item costs O(s).

**Order.** ``__len__`` is the number of sequences the run draws; epoch ``e`` visits every sequence once
in an order drawn from ``(seed, e)``; every rank builds the same.

**Tokenized once for the run**: an ``.npz`` of the tokenized rows in ``cache_dir`` (``--data-cache-path``;
by default ``$TNLG_CACHE/sft``, :func:`tnlg.data.paths.default_cache_dir`) keyed by everything that decides
the tokens: every row's segments (the rows' content, rendered by the template with its special tokens), the
tokenizer's fingerprint, the template and its special tokens, and ``loss_on_prompt``. It is written durably
and atomically (a temporary file, fsync, rename) and checked when read: a truncated or damaged file is
rebuilt, with a note naming it. The launching
process's check of the rows writes it (``tnlg finetune`` reads every row before any worker starts), so the
workers read it rather than tokenize again; in a worker rank 0 writes it when it is missing while the others
wait at ``barrier``. Where the folder cannot be written, each process tokenizes for itself. Rows are read and
checked by every rank first, so bad input is raised alike everywhere before anyone waits. No collectives
besides ``barrier``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..errors import UserError
from ..io import atomic_output
from .chat import ChatTemplate, Continued, Segment, chat_template_for, segments
from .fingerprint import fingerprint
from .paths import default_cache_dir
from .sft_rows import SFTRow, read_rows

__all__ = ["SFTReport", "SFTSamples", "SFTDataset", "build_sft_datasets", "tokenize_rows", "tokenize_segments", "fit_samples",
           "pack", "sequence_item", "CACHE_VERSION"]

CACHE_VERSION = 2


@dataclass
class SFTReport:
    """What one split became: rows read, sequences, counted target tokens, truncated and skipped samples."""

    samples: int
    sequences: int
    counted_tokens: int
    truncated: int
    skipped: int
    template: Optional[str] = None  # the chat template used, when rows had messages
    valid: Optional["SFTReport"] = field(default=None, repr=False)

    def line(self) -> str:
        text = (f"{self.samples} samples into {self.sequences} sequences, {self.counted_tokens} counted tokens, "
                f"{self.truncated} truncated, {self.skipped} skipped")
        if self.valid is not None:
            text += f" (validation: {self.valid.line()})"
        return text


@dataclass
class SFTSamples:
    """Samples flat: ``ids`` and ``counted`` of every token, sample ``k`` at ``offsets[k]:offsets[k + 1]``."""

    ids: np.ndarray  # int64
    counted: np.ndarray  # bool
    offsets: np.ndarray  # int64, len = samples + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        return self.ids[a:b], self.counted[a:b]


# --------------------------------------------------------------------------------------- tokenizing

def _row_segments(row: SFTRow, template: Optional[ChatTemplate]) -> list[Segment]:
    if row.messages is None:
        return [(row.prompt, False), (row.completion, True), (None, True)]
    assert template is not None
    return segments(row.messages, template, row.where)


def tokenize_rows(rows: Sequence[SFTRow], tokenizer, template: Optional[ChatTemplate],
                  loss_on_prompt: bool = False) -> SFTSamples:
    """Every row's ids and counted flags (see the module docstring)."""
    return tokenize_segments([_row_segments(r, template) for r in rows], tokenizer, loss_on_prompt)


def tokenize_segments(per_row: Sequence[Sequence[Segment]], tokenizer, loss_on_prompt: bool = False) -> SFTSamples:
    """The samples of each row's segments; every text encoded on its own, all in one ``encode_batch``; a
    segment that is an id (a special token cut out of a chat rendering) is that id, ``None`` the
    end-of-document id. A text with counted character ranges (a stretch of a chat template's rendering) is
    encoded with offsets (:meth:`~tnlg.data.tokenizer.Tokenizer.encode_with_offsets`; without a leading-space
    prefix where it is :class:`~tnlg.data.chat.Continued`), and a token is counted when it covers a counted
    character, as transformers' assistant mask counts from the token of a span's first character through the
    token of its last."""
    plain = [t for segs in per_row for t, c in segs if isinstance(t, str) and isinstance(c, bool)]
    stretches = {flag: [t for segs in per_row for t, c in segs if isinstance(t, str) and isinstance(c, tuple)
                        and isinstance(t, Continued) == flag] for flag in (False, True)}
    encoded = iter(tokenizer.encode_batch(plain) if plain else [])
    with_offsets = {flag: iter(tokenizer.encode_with_offsets(texts, continued=flag) if texts else [])
                    for flag, texts in stretches.items()}
    ids: list[int] = []
    counted: list[bool] = []
    offsets = [0]
    eod = int(tokenizer.eod_id)
    for segs in per_row:
        for text, count in segs:
            if isinstance(count, tuple):
                part, spans = next(with_offsets[isinstance(text, Continued)])
                flags = [loss_on_prompt or _covers(count, a, b) for a, b in spans]
            else:
                part = [eod] if text is None else [int(text)] if isinstance(text, int) else list(next(encoded))
                flags = [bool(count) or loss_on_prompt] * len(part)
            ids += part
            counted += flags
        offsets.append(len(ids))
    return SFTSamples(np.asarray(ids, dtype=np.int64), np.asarray(counted, dtype=bool),
                      np.asarray(offsets, dtype=np.int64))


def _covers(ranges: tuple[tuple[int, int], ...], a: int, b: int) -> bool:
    """Whether a token of characters ``[a, b)`` (at ``a`` when empty) covers a character of ``ranges``."""
    return any((a < hi and b > lo) if b > a else lo <= a < hi for lo, hi in ranges)


def fit_samples(samples: SFTSamples, seq_length: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, int]:
    """Samples cut to ``seq_length + 1`` tokens; ``(kept samples, truncated, skipped)``. A sample is skipped
    when no token after its first is counted within the cut."""
    keep, truncated, skipped = [], 0, 0
    for k in range(len(samples)):
        ids, counted = samples.sample(k)
        if len(ids) > seq_length + 1:
            ids, counted = ids[:seq_length + 1], counted[:seq_length + 1]
            if counted[1:].any():
                truncated += 1
        if not counted[1:].any():
            skipped += 1
            continue
        keep.append((ids, counted))
    return keep, truncated, skipped


# --------------------------------------------------------------------------------------- packing

def pack(lengths: Sequence[int], capacity: int, packing: bool = True) -> list[list[int]]:
    """Greedy first fit in order: sample ``k`` joins the first sequence whose lengths leave room for it
    (at most ``capacity`` in all), else starts a new one. Without ``packing``, one sample per sequence."""
    if not packing:
        return [[k] for k in range(len(lengths))]
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = np.full(2 * size, capacity, dtype=np.int64)  # a max tree over each sequence's free room
    bins: list[list[int]] = []
    for k, n in enumerate(lengths):
        node = 1
        while node < size:  # the leftmost leaf with room >= n (unopened sequences have full room)
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(k)
        room[node] -= n
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


def sequence_item(samples: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int, pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """One sequence of packed samples as a training item (the layout of the module docstring)."""
    stream = np.full(seq_length + 1, pad_id, dtype=np.int64)
    target = np.zeros(seq_length + 1, dtype=np.float32)  # target[p]: the token at p is a counted label
    block = np.zeros(seq_length + 1, dtype=np.int64)
    position = np.zeros(seq_length + 1, dtype=np.int64)
    at = 0
    for ids, counted in samples:
        n = len(ids)
        stream[at:at + n] = ids
        target[at + 1:at + n] = counted[1:]  # a sample's first token is no target of the one before it
        block[at:at + n] = at  # (a document's id: the position where it starts)
        position[at:at + n] = np.arange(n)
        at += n
    if at > seq_length + 1:
        raise ValueError(f"samples of {at} tokens do not fit a sequence of {seq_length + 1}")
    position[at:] = np.arange(seq_length + 1 - at)
    block[at:] = at
    return {"tokens": torch.from_numpy(stream[:-1].copy()), "labels": torch.from_numpy(stream[1:].copy()),
            "loss_mask": torch.from_numpy(target[1:].copy()), "position_ids": torch.from_numpy(position[:-1].copy()),
            "attention_mask": torch.from_numpy(block[:-1].copy())}


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` items cycling epochs of the packed sequences, each epoch in a fresh order drawn from
    ``(seed, epoch)``."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]], sequences: list[list[int]], seq_length: int,
                 pad_id: int, num_samples: int, seed: int):
        self.samples, self.sequences = samples, sequences
        self.seq_length, self.pad_id, self.seed = seq_length, int(pad_id), int(seed)
        self.num_samples = int(num_samples)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._orders[epoch] = rng.permutation(len(self.sequences))
        return self._orders[epoch]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} sequences")
        epoch, k = divmod(int(i), len(self.sequences))
        chosen = self.sequences[int(self.order(epoch)[k])]
        return sequence_item([self.samples[j] for j in chosen], self.seq_length, self.pad_id)

    def __repr__(self) -> str:
        return f"SFTDataset({len(self.samples)} samples in {len(self.sequences)} sequences, {self.num_samples} drawn)"


# --------------------------------------------------------------------------------------- building

def _cache_key(per_row: Sequence[Sequence[Segment]], tokenizer, template: Optional[ChatTemplate],
               loss_on_prompt: bool) -> str:
    """A digest of everything that decides the tokens: every row's segments (the rows' content as rendered,
    special tokens already ids), the tokenizer's fingerprint, the template with its special tokens, and
    ``loss_on_prompt``."""
    h = hashlib.sha256()
    head = {"version": CACHE_VERSION, "tokenizer": fingerprint(tokenizer), "loss_on_prompt": bool(loss_on_prompt),
            "eod_id": int(tokenizer.eod_id), "template": None if template is None else template.identity()}
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for segs in per_row:
        h.update(json.dumps(segs, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()[:32]


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _read_cache(file: str, rows: int, vocab_size: int) -> tuple[Optional[SFTSamples], Optional[str]]:
    """The samples of a cache file and ``None``, or ``None`` and why the file is not a cache of ``rows`` rows
    (``None`` and ``None`` when there is no file)."""
    if not os.path.isfile(file):
        return None, None
    try:
        with np.load(file, allow_pickle=False) as z:
            ids, counted, offsets = z["ids"], z["counted"], z["offsets"]
        if ids.dtype != np.int64 or counted.dtype != np.bool_ or offsets.dtype != np.int64:
            return None, f"arrays of types {ids.dtype}/{counted.dtype}/{offsets.dtype}, not int64/bool/int64"
        if ids.ndim != 1 or counted.shape != ids.shape or offsets.shape != (rows + 1,):
            return None, f"{len(offsets) - 1} samples of {ids.shape} ids and {counted.shape} flags for {rows} rows"
        if offsets[0] != 0 or offsets[-1] != len(ids) or (np.diff(offsets) < 0).any():
            return None, "sample offsets out of order"
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            return None, f"ids outside the vocabulary of {vocab_size}"
        return SFTSamples(ids, counted, offsets), None
    except Exception as err:  # noqa: BLE001 - a truncated or damaged file: zipfile, zlib, numpy and OS errors
        return None, f"{type(err).__name__}: {str(err)[:120]}"


def _tokenized(path: str, rows: list[SFTRow], tokenizer, template, loss_on_prompt: bool,
               cache_dir: Optional[str], barrier: Optional[Callable[[], None]]) -> SFTSamples:
    """The rows tokenized, through the cache in ``cache_dir`` (default ``$TNLG_CACHE/sft``; rank 0 writes it,
    durably and atomically, when it is missing or unreadable). Every rank renders the conversations first, so a
    template's error is raised alike everywhere. A cache file that is truncated or damaged is rebuilt with a
    note naming it; one that cannot be written (a read-only or full folder): each process tokenizes."""
    per_row = [_row_segments(r, template) for r in rows]
    folder = cache_dir or os.path.join(default_cache_dir(), "sft")
    file = os.path.join(folder, f"sft-{_cache_key(per_row, tokenizer, template, loss_on_prompt)}.npz")
    def cached_or_tokenized(then: str) -> tuple[SFTSamples, bool]:
        """The cache's samples, or (with a note when the file is there but unreadable) the rows tokenized;
        whether they were tokenized."""
        found, why = _read_cache(file, len(rows), tokenizer.vocab_size)
        if found is not None:
            return found, False
        if why:
            print(f"note: the tokenized cache {file} of {path} is unreadable ({why}); tokenizing the rows "
                  f"{then}.", file=sys.stderr, flush=True)
        return tokenize_segments(per_row, tokenizer, loss_on_prompt), True

    samples = None
    if _rank() == 0 or barrier is None:
        samples, made = cached_or_tokenized("again and rewriting it")
        if made:
            try:
                os.makedirs(folder, exist_ok=True)
                with atomic_output(file, "wb") as f:
                    np.savez(f, ids=samples.ids, counted=samples.counted, offsets=samples.offsets)
            except OSError:  # an unwritable cache: the other ranks find no file and tokenize for themselves
                pass
    if barrier is not None:
        barrier()
    return samples if samples is not None else cached_or_tokenized("in this process")[0]


def _build_split(path: str, tokenizer, seq_length: int, num_samples: int, seed: int, packing: bool,
                 loss_on_prompt: bool, cache_dir: Optional[str], barrier) -> tuple[SFTDataset, SFTReport]:
    rows = read_rows(path)
    template = chat_template_for(tokenizer) if any(r.messages is not None for r in rows) else None
    samples = _tokenized(path, rows, tokenizer, template, loss_on_prompt, cache_dir, barrier)
    kept, truncated, skipped = fit_samples(samples, seq_length)
    if not kept:
        raise UserError(f"fine-tuning data {path!r} has no usable sample: its {len(rows)} rows were all skipped, "
                        f"their prompts filling --seq-length {seq_length} with no completion token left. Use a "
                        "longer --seq-length or shorter prompts.")
    sequences = pack([len(ids) for ids, _ in kept], seq_length + 1, packing)
    counted = sum(int(c[1:].sum()) for _, c in kept)
    report = SFTReport(len(rows), len(sequences), counted, truncated, skipped,
                       None if template is None else template.describe())
    return SFTDataset(kept, sequences, seq_length, tokenizer.eod_id, num_samples or len(sequences), seed), report


def build_sft_datasets(train_path: str, valid_path: Optional[str], tokenizer, seq_length: int, *,
                       train_samples: int, valid_samples: int, seed: int, packing: bool = True,
                       loss_on_prompt: bool = False, cache_dir: Optional[str] = None,
                       barrier: Optional[Callable[[], None]] = None
                       ) -> tuple[SFTDataset, Optional[SFTDataset], SFTReport]:
    """The training and (with ``valid_path``) validation datasets of fine-tuning rows (``train_samples`` and
    ``valid_samples`` items; 0: every sequence once), and the report of what the rows became (its :meth:`SFTReport.line`; the validation split's in ``report.valid``). Every rank
    builds the same; bad rows are one :class:`UserError` naming file and line."""
    if seq_length < 1:
        raise UserError(f"--seq-length {seq_length} must be at least 1.")
    train, report = _build_split(train_path, tokenizer, seq_length, train_samples, seed, packing, loss_on_prompt,
                                 cache_dir, barrier)
    valid = None
    if valid_path:
        valid, report.valid = _build_split(valid_path, tokenizer, seq_length, valid_samples, seed, packing,
                                           loss_on_prompt, cache_dir, barrier)
    return train, valid, report
