"""Parameter counts: total and per tensor-parallel rank, by meta-device build and by formula.

The shard of every virtual TP rank is built on the meta device (no memory is
allocated) with :func:`tnlg.model.parameter_counts`; the closed-form count of
each rank, :func:`rank_counts_formula`, is printed beside it and the two are
checked against each other in the tests. What is split and what is replicated
(Megatron's layout, GPT-2 shapes, tied embeddings):

* split: attention QKV (weight + bias, per-rank heads from
  :func:`tnlg.config.partition_sizes`), attention output weight, MLP fc
  (weight + bias) and proj weight (per-rank width from the same function), and
  the word embedding (vocabulary padded to a multiple of ``128 * tp``, split evenly);
* replicated on every TP rank: both LayerNorms of every layer, the biases of the
  two row-parallel projections, the position embedding and the final LayerNorm.
"""

from __future__ import annotations

from typing import Optional

from ..config import GPTConfig

__all__ = ["rank_counts_formula", "replicated_per_rank", "parameter_report", "abstract_parameter_report"]


def replicated_per_rank(config: GPTConfig) -> int:
    """Parameters every TP rank holds in full: ``l (2h + h + 2h + h) + s h + 2h``."""
    l, h, s = config.num_layers, config.hidden_size, config.seq_length
    return l * 6 * h + s * h + 2 * h


def rank_counts_formula(config: GPTConfig, tp: int) -> list[dict]:
    """Closed-form count of each TP rank's shard, in the layout of ``tnlg.model.parameter_counts``.

    Each entry: ``params`` (including padded vocabulary rows), ``params_unpadded``
    and ``replicated``. Summed over ranks, ``params_unpadded`` equals
    :meth:`GPTConfig.num_parameters_formula` plus ``replicated * (tp - 1)``.
    """
    l, h, d = config.num_layers, config.hidden_size, config.head_dim
    vocab, vocab_padded = config.vocab_size, config.padded_vocab_size(tp)
    shard_rows = vocab_padded // tp
    replicated = replicated_per_rank(config)
    out = []
    for r, (heads, ffn) in enumerate(zip(config.heads_per_rank(tp), config.ffn_per_rank(tp))):
        width = heads * d
        per_layer = 3 * width * h + 3 * width + width * h + h * ffn + ffn + ffn * h
        real_rows = min(max(vocab - r * shard_rows, 0), shard_rows)
        sharded = l * per_layer
        out.append({"params": sharded + shard_rows * h + replicated,
                    "params_unpadded": sharded + real_rows * h + replicated,
                    "replicated": replicated})
    return out


def _meta_counts(config: GPTConfig, tp: int) -> Optional[dict]:
    """Counts from meta-device builds of every rank's shard, or ``None`` while the model is unavailable."""
    try:
        from ..model import parameter_counts
    except ImportError:
        return None
    return parameter_counts(config, tp)


def parameter_report(config: GPTConfig, tp: int, use_meta: bool = True) -> dict:
    """Total and per-rank parameters of ``config`` at tensor-parallel size ``tp``.

    ``per_rank`` comes from meta-device builds when ``use_meta`` (and the model
    module is importable), else from the formula; ``formula_per_rank`` is always
    the formula. ``largest``/``smallest`` are ranks by ``params`` (padding included:
    padded rows are allocated); ``imbalance_percent`` = largest / mean - 1, the time
    the other ranks wait for the largest one.
    """
    config.check_tensor_parallel(tp)
    formula_ranks = rank_counts_formula(config, tp)
    meta = _meta_counts(config, tp) if use_meta else None
    if meta is not None:
        per_rank, source = [dict(r) for r in meta["per_rank"]], "meta-device build of each rank's shard"
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
