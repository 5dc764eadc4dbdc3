"""Parameter counts: total and per tensor-parallel rank, from the layers and by formula.

:func:`parameter_counts` counts every virtual TP rank's shard from the layers' own
description of their splits (:meth:`tnlg.model.GPT.describe`: the layers themselves, built
on the meta device, nothing allocated); the closed-form count of each rank,
:meth:`tnlg.config.GPTConfig.parameters_per_rank` (the one formula; :func:`rank_counts_formula`
here), is printed beside it and the two are checked against each other in the tests.
What is split and what is replicated (Megatron's layout, GPT-2 shapes, tied embeddings):

* split: attention QKV (weight + bias, per-rank heads from
  :func:`tnlg.config.partition_sizes`), attention output weight, MLP fc
  (weight + bias) and proj weight (per-rank width from the same function), and
  the word embedding (vocabulary padded to a multiple of ``128 * tp``, split evenly);
* replicated on every TP rank: both LayerNorms of every layer, the biases of the
  two row-parallel projections, the position embedding and the final LayerNorm.
"""

from __future__ import annotations

import math

from ..config import GPTConfig

__all__ = ["parameter_counts", "rank_counts_formula", "replicated_per_rank", "parameter_report",
           "abstract_parameter_report"]


def replicated_per_rank(config: GPTConfig) -> int:
    """Parameters every TP rank holds in full (:meth:`GPTConfig.replicated_parameters`)."""
    return config.replicated_parameters()


def rank_counts_formula(config: GPTConfig, tp: int) -> list[dict]:
    """Closed-form count of each TP rank's shard (:meth:`GPTConfig.parameters_per_rank`), in the
    layout of :func:`parameter_counts`'s ``per_rank``."""
    return config.parameters_per_rank(tp)


def parameter_counts(config: GPTConfig, tp_size: int = 1) -> dict:
    """Parameter counts per TP rank, from the layers' description of every rank's shard.

    Returns ``total`` (unpadded: equals :meth:`GPTConfig.num_parameters_formula`),
    ``total_padded`` (with the padded embedding rows), ``replicated`` (parameters
    every TP rank holds a copy of) and ``per_rank``: for each TP rank ``params``
    (with padding), ``params_unpadded`` and ``replicated``. Per-rank counts sum to
    ``total_padded + replicated * (tp - 1)``.
    """
    from ..model import GPT  # deferred: imports torch, which ``tnlg plan`` does not need otherwise
    specs = GPT.describe(config, tp_size).values()
    per_rank = []
    for r in range(tp_size):
        n = n_unpadded = n_rep = 0
        for spec in specs:
            numel = math.prod(spec.local_shape(r))
            n += numel
            if spec.sharded:
                assert spec.dim is not None  # (a sharded spec names its dimension)
                start, rows = spec.start(r), spec.sizes[r]
                real = max(0, min(spec.shape[spec.dim], start + rows) - start)  # not vocabulary padding
                n_unpadded += numel // rows * real if rows else 0
            else:
                n_unpadded += numel
                n_rep += numel
        per_rank.append(dict(params=n, params_unpadded=n_unpadded, replicated=n_rep))
    replicated = per_rank[0]["replicated"]
    # key/value groups several TP ranks hold (shared slices): their extra copies are not more parameters
    copies = 0
    for sp in specs:
        if sp.sharded and sp.offsets and sp.dim is not None:
            copies += (sum(sp.sizes) - sp.shape[sp.dim]) * math.prod(sp.shape) // sp.shape[sp.dim]
    extra = replicated * (tp_size - 1) + copies
    return dict(total=sum(r["params_unpadded"] for r in per_rank) - extra,
                total_padded=sum(r["params"] for r in per_rank) - extra,
                replicated=replicated, per_rank=per_rank, tp_size=tp_size,
                padded_vocab_size=config.padded_vocab_size(tp_size))


def parameter_report(config: GPTConfig, tp: int, use_meta: bool = True) -> dict:
    """Total and per-rank parameters of ``config`` at tensor-parallel size ``tp``.

    ``per_rank`` comes from the layers' description (:func:`parameter_counts`) when
    ``use_meta``, else from the formula; ``formula_per_rank`` is always
    the formula. ``largest``/``smallest`` are ranks by ``params`` (padding included:
    padded rows are allocated); ``imbalance_percent`` = largest / mean - 1, the time
    the other ranks wait for the largest one.
    """
    config.check_tensor_parallel(tp)
    formula_ranks = rank_counts_formula(config, tp)
    meta = parameter_counts(config, tp) if use_meta else None
    if meta is not None:
        per_rank, source = [dict(r) for r in meta["per_rank"]], "layer description of each rank's shard"
        total, total_padded = int(meta["total"]), int(meta["total_padded"])
    else:
        per_rank, source = formula_ranks, "per-rank formula (model not built)"
        total = config.num_parameters_formula()
        total_padded = total + (config.padded_vocab_size(tp) - config.vocab_size) * config.hidden_size
    sizes = [r["params"] for r in per_rank]
    largest = max(range(tp), key=lambda r: (sizes[r], -r))
    smallest = min(range(tp), key=lambda r: (sizes[r], r))
    heads = config.heads_per_rank(tp)
    ffn = config.ffn_per_rank(tp)
    return {
        "source": source,
        "total": total,
        "total_formula": config.num_parameters_formula(),
        "active": config.active_parameters() if config.num_experts is not None else None,
        "total_padded": total_padded,
        "padded_vocab_size": config.padded_vocab_size(tp),
        "replicated_per_rank": per_rank[0]["replicated"],
        "per_rank": per_rank,
        "formula_per_rank": formula_ranks,
        "heads_per_rank": heads,
        "ffn_per_rank": ffn,
        "uneven": len(set(heads)) > 1 or len(set(ffn)) > 1,
        "largest_rank": {"rank": largest, "params": sizes[largest], "heads": heads[largest]},
        "smallest_rank": {"rank": smallest, "params": sizes[smallest], "heads": heads[smallest]},
        "imbalance_percent": 100.0 * (max(sizes) * tp / sum(sizes) - 1.0),
    }


def abstract_parameter_report(params: int, tp: int) -> dict:
    """The ZeRO paper's abstract model: ``params`` parameters split evenly over ``tp`` ranks."""
    per = -(-params // tp)
    return {
        "source": "abstract model (--params): split evenly, nothing replicated",
        "total": params, "total_formula": params, "total_padded": params,
        "padded_vocab_size": None, "replicated_per_rank": 0,
        "per_rank": [{"params": per, "params_unpadded": per, "replicated": 0}] * tp,
        "formula_per_rank": None, "heads_per_rank": None, "ffn_per_rank": None, "uneven": False,
        "largest_rank": {"rank": 0, "params": per, "heads": None},
        "smallest_rank": {"rank": tp - 1, "params": per, "heads": None},
        "imbalance_percent": 0.0,
    }
