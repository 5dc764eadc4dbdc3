"""Tensor- and pipeline-parallel text generation with a KV cache: greedy, temperature, top-k, top-p.

Python API::

    texts = tnlg.generate(model, tokenizer, ["Once upon a time"], max_new_tokens=32, top_k=40, seed=1)
    ids = generate_tokens(model, [[464, 2068]], SamplingOptions(max_new_tokens=8, greedy=True))
    ids = tnlg.generate_ids(model, [[464, 2068]], max_new_tokens=8, greedy=True)  # the same, options as keywords

A batch of prompts of different lengths runs as one: a **prefill** of every prompt (right-padded, each row
at its own length in the KV cache, :mod:`.steps`), then one **decode** step per new token, every row at its
own position, so each row continues exactly as it would alone (up to float rounding). Without the cache
the whole sequence is recomputed each step.

Tensor parallelism: the logits stay vocabulary shards. Greedy and top-k take each
rank's local top candidates and all-gather only those (:mod:`tnlg.parallel.vocab`);
sampling without top-k all-gathers the last position's ``[b, V]`` logits. The draw
uses one CPU generator per prompt, seeded with ``seed + prompt index``, applied
after the distribution is formed, so a seed gives the same tokens at every TP size
and whatever else is in the batch; the chosen ids are then broadcast from TP rank 0
so every TP rank feeds the same token. Collectives per new token: the model's TP
all-reduces, one all-gather of candidates, one broadcast of ``[b]`` ids.

Pipeline parallelism (``model`` a :class:`~tnlg.model.stage.StageModel`, e.g. from
:func:`tnlg.generation.loading.load_for_inference` at ``PP > 1``): each stage keeps the KV cache of its
own layers, the hidden state of each new position goes stage to stage, the last stage chooses
the token as above and broadcasts it to every stage (:mod:`tnlg.model.inference`);
every rank of the job returns the same ids, the same as without a pipeline.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence, Union

import torch

from ..errors import UserError
from ..model.inference import model_device
from ..model.kv_cache import KVCache
from .options import SamplingOptions, check_sampling
from .sampling import make_generators
from .steps import choose_next, decode, prefill, recompute, right_padded

__all__ = ["generate", "generate_tokens", "generate_ids", "continuation_text", "check_sampling", "check_prompts"]


def check_prompts(prompts, seq_length: int, vocab_size: int) -> list[list[int]]:
    """``prompts`` as lists of ints, each at most ``seq_length`` tokens (the model's positions) of ids below
    ``vocab_size``; else one paragraph."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise UserError("prompts must be a non-empty list of token-id lists.")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise UserError(f"prompt {i} has no tokens; give at least one (the text API starts an empty prompt "
                            "from the end-of-document token).")
        if len(p) > seq_length:
            raise UserError(f"prompt {i} is {len(p)} tokens long, longer than the model's seq_length="
                            f"{seq_length} (its max_position_embeddings); shorten it to at most {seq_length} "
                            f"tokens.")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size}).")
        out.append(p)
    return out


@torch.no_grad()
def generate_tokens(model, prompts: Sequence[Sequence[int]], options: SamplingOptions, *,
                    vocab_size: Optional[int] = None, batch_size: Optional[int] = None, seed_offset: int = 0,
                    use_cache: bool = True) -> list[list[int]]:
    """New token ids for each prompt (a list of token ids), in prompt order, chosen as ``options`` says
    (:class:`~tnlg.generation.options.SamplingOptions`; prompt ``i`` draws from ``seed + seed_offset + i``).
    Generation stops where prompt + new tokens would exceed the model's positions (``max_position_embeddings``; the longest prompt
    of a batch decides; a warning says so). ``vocab_size`` limits the ids that can be chosen (default the
    model's); ``batch_size`` prompts run together (default all); ``use_cache=False`` recomputes every
    sequence at each step. Every TP rank and pipeline stage of a group must call this with the same
    arguments; all get the same result."""
    cfg = model.config
    vocab = min(vocab_size or cfg.vocab_size, cfg.vocab_size)
    prompts = check_prompts(prompts, cfg.max_position_embeddings, cfg.vocab_size)
    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size!r}.")
    step = batch_size or len(prompts)
    seed = options.seed
    if seed is None:  # a random seed (it may differ across TP ranks: the broadcast keeps their tokens equal)
        seed = int(torch.randint(0, 2**62, ()).item())
    out: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        for b0 in range(0, len(prompts), step):
            chunk = prompts[b0:b0 + step]
            gens = make_generators([seed + seed_offset + b0 + i for i in range(len(chunk))])
            out += _generate_batch(model, chunk, options, gens, vocab, use_cache)
    finally:
        model.train(was_training)
    return out


def generate_ids(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *, greedy: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 eod_id: Optional[int] = None, stop_at_eod: bool = True, use_cache: bool = True,
                 pad_id: Optional[int] = None, vocab_size: Optional[int] = None, batch_size: Optional[int] = None,
                 seed_offset: int = 0) -> list[list[int]]:
    """:func:`generate_tokens` with the sampling options as keywords: a row stops after ``eod_id`` when
    ``stop_at_eod`` (the returned ids end with it). ``pad_id`` has no effect (no row attends to padding,
    whatever its ids)."""
    del pad_id
    stop = (eod_id,) if eod_id is not None and stop_at_eod else ()
    options = SamplingOptions(max_new_tokens, greedy, temperature, top_k, top_p, seed, stop)
    return generate_tokens(model, prompts, options, vocab_size=vocab_size, batch_size=batch_size,
                           seed_offset=seed_offset, use_cache=use_cache)


def _generate_batch(model, prompts: list[list[int]], options: SamplingOptions, gens, vocab: int,
                    use_cache: bool) -> list[list[int]]:
    """One batch: a prefill of every prompt, then decode steps (each row at its own length)."""
    ps, cfg = model.ps, model.config
    device = model_device(model)
    b, lengths = len(prompts), [len(p) for p in prompts]
    longest, max_new = max(lengths), options.max_new_tokens
    if longest + max_new > cfg.max_position_embeddings:
        room = cfg.max_position_embeddings - longest
        warnings.warn(f"prompt of {longest} tokens + {max_new} new tokens exceeds the model's "
                      f"max_position_embeddings={cfg.max_position_embeddings} positions; "
                      f"generating {room} new tokens.", stacklevel=3)
        max_new = room
    if max_new == 0:
        return [[] for _ in prompts]
    tokens = right_padded(prompts, longest + max_new, device=device)  # (row i's new ids follow its prompt)
    ends = torch.tensor(lengths, device=device)  # each row's tokens so far
    cache = KVCache(model, b, longest + max_new) if use_cache else None
    new = torch.zeros(b, max_new, dtype=torch.long, device=device)
    stop = torch.tensor(options.stop_ids, dtype=torch.long, device=device) if options.stop_ids else None
    # Bookkeeping stays on the device: no host sync per token (on a GPU the next step's kernels are
    # queued while this one runs); "all rows done?" is read every `check_every` tokens.
    done = torch.zeros(b, dtype=torch.bool, device=device)
    produced = torch.zeros(b, dtype=torch.long, device=device)
    check_every = 1 if device.type == "cpu" else 16
    nxt, taken = None, 0
    for step in range(max_new):
        if cache is None:
            logits = recompute(model, tokens[:, :longest + step], ends)
        elif nxt is None:
            logits = prefill(model, cache, tokens[:, :longest], lengths)
        else:
            logits = decode(model, cache, nxt)
        nxt = choose_next(logits, ps, options, vocab, gens, device)
        tokens.scatter_(1, ends[:, None], nxt[:, None])
        ends += 1
        new[:, step] = nxt
        taken = step + 1
        produced += ~done
        if stop is not None:
            done |= torch.isin(nxt, stop)
            if taken % check_every == 0 and bool(done.all()):
                break
    counts = produced.tolist()
    rows = new[:, :taken].tolist()
    return [row[:n] for row, n in zip(rows, counts)]


def generate(model, tokenizer, prompts: Union[str, Sequence[str]], max_new_tokens: int = 32, *,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None, stop_at_eod: bool = True, use_cache: bool = True,
             batch_size: Optional[int] = None, seed_offset: int = 0) -> list[str]:
    """Continuations (text after each prompt, without the end-of-document token) of ``prompts``:
    ``decode(encode(prompt)) + text == decode(encode(prompt) + new ids)`` (:func:`continuation_text`).

    ``tokenizer`` is any object with ``encode``, ``decode``, ``vocab_size`` and
    ``eod_id``; an empty prompt starts from the end-of-document token. Only ids the
    tokenizer knows are ever chosen. The options are :class:`~tnlg.generation.options.SamplingOptions`'
    (``stop_at_eod``: stop after the tokenizer's ``eod_id``).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    ids = [list(tokenizer.encode(p)) or [tokenizer.eod_id] for p in prompts]
    options = SamplingOptions(max_new_tokens, greedy, temperature, top_k, top_p, seed,
                              (tokenizer.eod_id,) if stop_at_eod else ())
    out = generate_tokens(model, ids, options, vocab_size=tokenizer.vocab_size, batch_size=batch_size,
                          seed_offset=seed_offset, use_cache=use_cache)
    return [continuation_text(tokenizer, p, new, stop_at_eod) for p, new in zip(ids, out)]


def continuation_text(tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int], stop_at_eod: bool = True) -> str:
    """The text that ``new_ids`` add after ``prompt_ids``: the suffix of ``decode(prompt + new)``
    after ``decode(prompt)`` (without a final end-of-document token when ``stop_at_eod``).

    Decoding the new ids alone is wrong for most tokenizers: SentencePiece drops the leading
    space marker of the first piece it decodes (the prompt "list of" + new "▁the" would read
    "list ofthe"), and a byte-level BPE may split a character's UTF-8 bytes across the boundary.
    Decoding the whole sequence gives ``decode(prompt) + text == decode(prompt + new)``.
    """
    new_ids = list(new_ids)
    if stop_at_eod and new_ids and new_ids[-1] == tokenizer.eod_id:
        new_ids = new_ids[:-1]
    head = tokenizer.decode(list(prompt_ids))
    full = tokenizer.decode(list(prompt_ids) + new_ids)
    # full starts with head for every tokenizer tnlg has; were the prompt's decoding to change with
    # what follows, the text after the part both share is still the honest continuation
    return full[len(os.path.commonprefix([head, full])):]
