"""Model configuration with Megatron's field names, presets, and the one partition function.

:func:`partition_sizes` is the single place that decides how a dimension is
split over tensor-parallel ranks (attention heads, MLP width); layers,
checkpoints and the planner all call it, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .errors import UserError

__all__ = ["GPTConfig", "divisors", "partition_sizes", "stage_layer_counts", "padded_vocab_size", "PRESETS", "RECOMPUTE_GRANULARITIES",
           "LR_DECAY_STYLES"]

RECOMPUTE_GRANULARITIES = (None, "selective", "full")
# --lr-decay-style's values, Megatron-LM's names (tnlg.optim.LRSchedule also runs Megatron's inverse-square-root,
# the schedule a converted checkpoint may record); torch-free for tnlg pretrain --help
LR_DECAY_STYLES = ("cosine", "linear", "constant")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order (none for ``n < 1``): the valid sizes an error
    lists when a parallel size does not divide what it splits."""
    return [d for d in range(1, n + 1) if n % d == 0]


def partition_sizes(n: int, tp: int) -> list[int]:
    """Split ``n`` units over ``tp`` ranks as evenly as possible, larger parts first.

    Sizes differ by at most one: 28 heads over 8 ranks -> [4, 4, 4, 4, 3, 3, 3, 3].
    """
    if tp < 1 or n < tp:
        raise ValueError(f"cannot split {n} units over {tp} ranks (need 1 <= tp <= {n}).")
    base, extra = divmod(n, tp)
    return [base + 1 if r < extra else base for r in range(tp)]


def stage_layer_counts(num_layers: int, stages: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> list[int]:
    """Layers per pipeline stage: ``first``/``last`` fixed where given, the rest as even as possible,
    larger first. A clear :class:`UserError` when a stage would get no layer."""
    fixed = {0: first, stages - 1: last} if stages > 1 else {}
    fixed = {s: n for s, n in fixed.items() if n is not None}
    what = (f"{num_layers} layers over --pipeline-model-parallel-size {stages}"
            + "".join(f", {'first' if s == 0 else 'last'} stage {n}" for s, n in sorted(fixed.items())))
    free = [s for s in range(stages) if s not in fixed]
    rest = num_layers - sum(fixed.values())
    if any(n < 1 for n in fixed.values()) or (free and rest < len(free)) or (not free and rest != 0):
        raise UserError(f"{what}: every pipeline stage needs at least one transformer layer and the stages "
                        f"together exactly {num_layers}; valid: --pipeline-model-parallel-size at most "
                        f"{num_layers}, and --decoder-first/last-pipeline-num-layers that leave at least one "
                        f"layer for each other stage.")
    counts = dict(fixed)
    counts.update(zip(free, partition_sizes(rest, len(free)) if free else []))
    return [counts[s] for s in range(stages)]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of ``divisible_by * tp``.

    Padded rows are masked out of the softmax, so the loss does not depend on ``tp``.
    """
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class GPTConfig:
    """GPT-2 architecture hyper-parameters (Megatron names).

    ``ffn_hidden_size`` defaults to ``4 * hidden_size``; ``seq_length`` is also the
    number of learned positions. ``init_method_std`` initialises every matrix;
    the two residual output projections use ``std / sqrt(2 * num_layers)``
    (GPT-2 / Megatron scaled init).

    How the model runs, not what it is (a checkpoint may be resumed with other values):
    ``sequence_parallel`` splits the activations between the tensor-parallel regions along
    the sequence over the TP group (Korthikanti et al. 2022; no effect at TP 1);
    ``recompute_granularity`` is ``None`` (keep all activations), ``"selective"`` (recompute
    the attention core in backward) or ``"full"`` (recompute every block from its input).
    ``recompute_activations=True`` is the older spelling of ``"full"``.

    Two choices of Megatron-LM's, under its argument names (the defaults are GPT-2's and every
    earlier tnlg checkpoint's): ``openai_gelu`` is the GELU of the MLP in tanh form (True) or the
    exact ``x * Phi(x)`` with the error function (False: Megatron-LM's default, where
    ``--openai-gelu`` selects tanh); ``untie_embeddings_and_output_weights`` gives the LM head its
    own vocab-parallel weight ``lm_head.weight`` instead of the word embedding.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    vocab_size: int = 256
    ffn_hidden_size: Optional[int] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    recompute_activations: bool = False
    seed: int = 1234
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    openai_gelu: bool = True
    untie_embeddings_and_output_weights: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "ffn_hidden_size", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            near = sorted(divisors(self.hidden_size), key=lambda d: abs(d - self.num_attention_heads))[:4]
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: every head needs the same width. Head counts that "
                f"divide {self.hidden_size} near {self.num_attention_heads}: {sorted(near)}.")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {value!r}.")
        if self.init_method_std <= 0:
            raise ValueError(f"GPTConfig.init_method_std must be positive, got {self.init_method_std!r}.")
        for name in ("sequence_parallel", "recompute_activations", "openai_gelu",
                     "untie_embeddings_and_output_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"GPTConfig.recompute_granularity must be one of {RECOMPUTE_GRANULARITIES} "
                             f"(None: no recomputation), got {self.recompute_granularity!r}.")
        if self.recompute_activations and self.recompute_granularity == "selective":
            raise ValueError("GPTConfig.recompute_activations=True means full recomputation (every block), which "
                             "contradicts recompute_granularity='selective' (the attention core only); set one "
                             "of them.")

    @property
    def effective_recompute_granularity(self) -> Optional[str]:
        """``"full"``, ``"selective"`` or ``None``: ``recompute_granularity``, else ``"full"`` when
        ``recompute_activations`` is set."""
        return self.recompute_granularity or ("full" if self.recompute_activations else None)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def max_tensor_parallel_size(self) -> int:
        """Largest TP the model allows: every rank needs at least one head (and one MLP column)."""
        return min(self.num_attention_heads, self.ffn_hidden_size)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise a ``ValueError`` naming the largest valid TP when ``tp`` cannot split this model."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}.")
        if tp > self.num_attention_heads:
            raise ValueError(
                f"tensor-parallel size {tp} is larger than num_attention_heads={self.num_attention_heads}: "
                f"every rank needs at least one whole head. The largest valid tensor-parallel size for "
                f"attention is {self.num_attention_heads} (heads are split as evenly as possible, so "
                f"any size from 1 to {self.num_attention_heads} works).")
        if tp > self.ffn_hidden_size:
            raise ValueError(f"tensor-parallel size {tp} is larger than ffn_hidden_size={self.ffn_hidden_size}; "
                             f"the largest valid tensor-parallel size is {self.max_tensor_parallel_size()}.")

    def heads_per_rank(self, tp: int) -> list[int]:
        self.check_tensor_parallel(tp)
        return partition_sizes(self.num_attention_heads, tp)

    def ffn_per_rank(self, tp: int) -> list[int]:
        self.check_tensor_parallel(tp)
        return partition_sizes(self.ffn_hidden_size, tp)

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp, self.make_vocab_size_divisible_by)

    def num_parameters_formula(self, vocab_size: Optional[int] = None, final_layernorm: bool = True) -> int:
        """Narayanan et al. 2021 eq. 2, generalised to any ffn width:
        ``l (4h^2 + 2 h f + 9h + f) + (V + s) h`` (+ 2h for the final LayerNorm; + V h for an
        untied output layer).
        With f = 4h this is ``12 l h^2 + 13 l h + (V + s) h``. (The TP=1 case of
        :meth:`parameters_per_rank`.)"""
        total = self.parameters_per_rank(1, vocab_size)[0]["params_unpadded"]
        return total - (0 if final_layernorm else 2 * self.hidden_size)

    def replicated_parameters(self) -> int:
        """Parameters every TP rank holds in full: ``l (2h + h + 2h + h) + s h + 2h`` (both LayerNorms
        and the two row-parallel biases of every layer, the position embedding, the final LayerNorm)."""
        l, h, s = self.num_layers, self.hidden_size, self.seq_length
        return l * 6 * h + s * h + 2 * h

    def parameters_per_rank(self, tp: int, vocab_size: Optional[int] = None) -> list[dict]:
        """Closed-form parameter count of each TP rank's shard (the one parameter-count formula).

        Each entry: ``params`` (including padded vocabulary rows), ``params_unpadded``
        and ``replicated`` (:meth:`replicated_parameters`). Split over TP: QKV (weight + bias,
        whole heads per rank), the attention output weight, MLP fc (weight + bias) and proj
        weight, and the word embedding (vocabulary padded to a multiple of
        ``make_vocab_size_divisible_by * tp``, split evenly; an untied output layer splits the same
        way and doubles that term). Summed over ranks,
        ``params_unpadded`` is :meth:`num_parameters_formula` plus ``replicated * (tp - 1)``.
        """
        l, h, d = self.num_layers, self.hidden_size, self.head_dim
        vocab = self.vocab_size if vocab_size is None else vocab_size
        shard_rows = padded_vocab_size(vocab, tp, self.make_vocab_size_divisible_by) // tp
        replicated = self.replicated_parameters()
        tables = 2 if self.untie_embeddings_and_output_weights else 1  # embedding (+ output layer)
        out = []
        for r, (heads, ffn) in enumerate(zip(self.heads_per_rank(tp), self.ffn_per_rank(tp))):
            width = heads * d
            sharded = l * (3 * width * h + 3 * width + width * h + h * ffn + ffn + ffn * h)
            real_rows = min(max(vocab - r * shard_rows, 0), shard_rows)
            out.append({"params": sharded + tables * shard_rows * h + replicated,
                        "params_unpadded": sharded + tables * real_rows * h + replicated,
                        "replicated": replicated})
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys {unknown}; valid keys: {sorted(known)}.")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named model shape (see :data:`PRESETS`), optionally with fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})


GPT2_VOCAB = 50257

PRESETS: dict[str, dict] = {
    # a model that trains in minutes on two CPU cores
    "tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=2000),
    "gpt2-small": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=GPT2_VOCAB),
    "gpt2-medium": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=GPT2_VOCAB),
    "gpt2-large": dict(num_layers=36, hidden_size=1280, num_attention_heads=20, seq_length=1024, vocab_size=GPT2_VOCAB),
    "gpt2-xl": dict(num_layers=48, hidden_size=1600, num_attention_heads=25, seq_length=1024, vocab_size=GPT2_VOCAB),
    "megatron-8.3b": dict(num_layers=72, hidden_size=3072, num_attention_heads=24, seq_length=1024,
                          vocab_size=GPT2_VOCAB, hidden_dropout=0.1, attention_dropout=0.1),
    "tnlg-17b": dict(num_layers=78, hidden_size=4256, num_attention_heads=28, seq_length=1024,
                     vocab_size=GPT2_VOCAB, hidden_dropout=0.1, attention_dropout=0.1),
}
