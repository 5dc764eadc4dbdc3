"""Tensor- and pipeline-parallel text generation with a KV cache: greedy, temperature, top-k, top-p.

Python API::

    texts = tnlg.generate(model, tokenizer, ["Once upon a time"], max_new_tokens=32, top_k=40, seed=1)
    ids = tnlg.generate_ids(model, [[464, 2068]], max_new_tokens=8, greedy=True)

Batches of prompts of different lengths are **left-padded**: an attention mask keeps
every row from seeing its padding and per-row position ids start at 0 at the row's
first real token, so each row continues exactly as it would alone (up to float
rounding). With the KV cache (default) the prefix is run once and every new token
costs one single-position forward; without it the whole sequence is recomputed
each step.

Tensor parallelism: the logits stay vocabulary shards. Greedy and top-k take each
rank's local top candidates and all-gather only those (:mod:`tnlg.parallel.vocab`);
sampling without top-k all-gathers the last position's ``[b, V]`` logits. The draw
uses one CPU generator per prompt, seeded with ``seed + prompt index``, applied
after the distribution is formed, so a seed gives the same tokens at every TP size
and whatever else is in the batch; the chosen ids are then broadcast from TP rank 0
so every TP rank feeds the same token. Collectives per new token: the model's TP
all-reduces, one all-gather of candidates, one broadcast of ``[b]`` ids.

Pipeline parallelism (``model`` a :class:`~tnlg.model.stage.StageModel`, e.g. from
:func:`tnlg.checkpoint.load_for_inference` at ``PP > 1``): each stage keeps the KV cache of its
own layers, the hidden state of each new position goes stage to stage, the last stage chooses
the token as above and broadcasts it to every stage (:mod:`tnlg.model.inference`);
every rank of the job returns the same ids, the same as without a pipeline.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import UserError
from ..model import KVCache
from ..model.inference import forward_logits, from_last_stage, model_device
from ..parallel.vocab import full_vocab_candidates, vocab_parallel_argmax, vocab_parallel_topk
from .sampling import make_generators, sample_from_candidates

__all__ = ["generate", "generate_ids", "continuation_text", "check_sampling", "check_prompts"]


def check_sampling(max_new_tokens, greedy, temperature, top_k, top_p) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
    if not greedy and not temperature > 0:
        raise UserError(f"temperature must be > 0 when sampling, got {temperature!r} (use greedy=True / "
                        "--greedy for argmax decoding).")
    if not isinstance(top_k, int) or top_k < 0:
        raise UserError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {top_k!r}.")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {top_p!r}.")


def check_prompts(prompts, seq_length: int, vocab_size: int) -> list[list[int]]:
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
                            f"{seq_length}; shorten it to at most {seq_length} tokens.")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size}).")
        out.append(p)
    return out


@torch.no_grad()
def generate_ids(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *, greedy: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 eod_id: Optional[int] = None, stop_at_eod: bool = True, use_cache: bool = True,
                 pad_id: Optional[int] = None, vocab_size: Optional[int] = None, batch_size: Optional[int] = None,
                 seed_offset: int = 0) -> list[list[int]]:
    """New token ids for each prompt (a list of token ids), in prompt order.

    ``greedy`` (or ``temperature == 0``) takes the argmax; otherwise sample from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` best (0 = all) and
    to the nucleus of mass ``top_p``. Prompt ``i`` draws from a CPU generator seeded
    with ``seed + seed_offset + i`` (``seed=None``: random). A row stops after
    ``eod_id`` when ``stop_at_eod`` (the returned ids end with it). Generation stops
    where prompt + new tokens would exceed the model's ``seq_length`` (the longest
    prompt of a batch decides; a warning says so). ``vocab_size`` limits the ids that
    can be chosen (default the model's). Every TP rank and pipeline stage of a group
    must call this with the same arguments; all get the same result.
    """
    cfg = model.config
    vocab = min(vocab_size or cfg.vocab_size, cfg.vocab_size)
    greedy = greedy or temperature == 0
    check_sampling(max_new_tokens, greedy, temperature, top_k, top_p)
    prompts = check_prompts(prompts, cfg.seq_length, cfg.vocab_size)
    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size!r}.")
    step = batch_size or len(prompts)
    if seed is None:  # a random seed (it may differ across TP ranks: the broadcast keeps their tokens equal)
        seed = int(torch.randint(0, 2**62, ()).item())
    out: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        for b0 in range(0, len(prompts), step):
            chunk = prompts[b0:b0 + step]
            gens = make_generators([seed + seed_offset + b0 + i for i in range(len(chunk))])
            out += _generate_batch(model, chunk, max_new_tokens, greedy, temperature, top_k, top_p, gens,
                                   eod_id if stop_at_eod else None,
                                   pad_id if pad_id is not None else (eod_id if eod_id is not None else 0),
                                   use_cache, vocab)
    finally:
        model.train(was_training)
    return out


def _choose(logits: Optional[torch.Tensor], ps, vocab: int, greedy: bool, temperature: float, top_k: int,
            top_p: float, gens, device) -> torch.Tensor:
    """The next id per row from last-position vocab shards ``[b, V/tp]`` (the last pipeline stage's;
    ``None`` on the other stages), identical on all TP ranks and pipeline stages."""
    if logits is None:  # a stage before the last: the id comes from the last stage
        return from_last_stage(torch.empty(len(gens), dtype=torch.long, device=device), ps)
    logits = logits.float()
    if greedy:
        nxt = vocab_parallel_argmax(logits, ps, vocab)
    else:
        if top_k > 0:
            values, ids = vocab_parallel_topk(logits, ps, vocab, top_k)
        else:
            values, ids = full_vocab_candidates(logits, ps, vocab)
        nxt = sample_from_candidates(values, ids, temperature, top_p, gens)
    nxt = nxt.contiguous()
    if ps.tp_size > 1:  # the candidates are identical already; this makes the choice so by construction
        dist.broadcast(nxt, src=ps.tp_src_rank, group=ps.tp_group)
    return from_last_stage(nxt, ps)


def _generate_batch(model, prompts: list[list[int]], max_new: int, greedy: bool, temperature: float, top_k: int,
                    top_p: float, gens, stop_id: Optional[int], pad_id: int, use_cache: bool,
                    vocab: int) -> list[list[int]]:
    ps, cfg = model.ps, model.config
    device = model_device(model)
    b = len(prompts)
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    if longest + max_new > cfg.seq_length:
        room = cfg.seq_length - longest
        warnings.warn(f"prompt of {longest} tokens + {max_new} new tokens exceeds seq_length={cfg.seq_length}; "
                      f"generating {room} new tokens.", stacklevel=3)
        max_new = room
    total = longest + max_new
    tokens = torch.full((b, total), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p):longest] = torch.tensor(p)
    tokens = tokens.to(device)
    pads = torch.tensor([longest - n for n in lengths], device=device)
    padded = bool((pads > 0).any())
    if padded:  # left padding: rows never attend to their pads; positions start at each row's first token
        ar = torch.arange(total, device=device)
        positions = (ar[None, :] - pads[:, None]).clamp(min=0)
        allowed = torch.ones(total, total, dtype=torch.bool, device=device).tril()[None] & \
            (ar[None, None, :] >= pads[:, None, None])
        allowed |= torch.eye(total, dtype=torch.bool, device=device)[None]  # pad queries: themselves (no NaN)
    cache = KVCache(model, b, total) if use_cache and max_new > 0 else None
    # Bookkeeping stays on the device: no host sync per token (on a GPU the next step's kernels are
    # queued while this one runs); "all rows done?" is read every `check_every` tokens.
    done = torch.zeros(b, dtype=torch.bool, device=device)
    produced = torch.zeros(b, dtype=torch.long, device=device)
    check_every = 1 if device.type == "cpu" else 16
    cur = longest
    for step in range(max_new):
        start = cur - 1 if (cache is not None and step > 0) else 0
        kwargs = {}
        if padded:
            kwargs = dict(position_ids=positions[:, start:cur], attention_mask=allowed[:, start:cur, :cur])
        logits = forward_logits(model, tokens[:, start:cur], kv_cache=cache, last_only=True, **kwargs)
        nxt = _choose(None if logits is None else logits[:, -1], ps, vocab, greedy, temperature, top_k, top_p,
                      gens, device)
        tokens[:, cur] = nxt
        cur += 1
        produced += ~done
        if stop_id is not None:
            done |= nxt == stop_id
            if (step + 1) % check_every == 0 and bool(done.all()):
                break
    counts = produced.tolist()
    rows = tokens[:, longest:cur].tolist()
    return [row[:n] for row, n in zip(rows, counts)]


def generate(model, tokenizer, prompts: Union[str, Sequence[str]], max_new_tokens: int = 32, *,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None, stop_at_eod: bool = True, use_cache: bool = True,
             batch_size: Optional[int] = None, seed_offset: int = 0) -> list[str]:
    """Continuations (text after each prompt, without the end-of-document token) of ``prompts``:
    ``decode(encode(prompt)) + text == decode(encode(prompt) + new ids)`` (:func:`continuation_text`).

    ``tokenizer`` is any object with ``encode``, ``decode``, ``vocab_size`` and
    ``eod_id``; an empty prompt starts from the end-of-document token. Only ids the
    tokenizer knows are ever chosen. See :func:`generate_ids` for the options.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    ids = [list(tokenizer.encode(p)) or [tokenizer.eod_id] for p in prompts]
    out = generate_ids(model, ids, max_new_tokens, greedy=greedy, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, eod_id=tokenizer.eod_id, stop_at_eod=stop_at_eod,
                       use_cache=use_cache, vocab_size=tokenizer.vocab_size, batch_size=batch_size,
                       seed_offset=seed_offset)
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
