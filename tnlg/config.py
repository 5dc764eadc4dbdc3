"""Model configuration with Megatron's field names, presets, and the one partition function.

Every model field is declared once (:func:`option`: its flag, help, check, whether it is architecture);
``tnlg pretrain``'s model options, the checkpoint's architecture record and the Megatron argument
mapping are read from the declarations. :func:`stage_parts` says which modules a pipeline stage holds
(the model, FSDP's units and the planner ask it). :func:`partition_sizes` is the single place that decides how a dimension is
split over tensor-parallel ranks (attention heads, MLP width); layers,
checkpoints and the planner all call it, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from .errors import UserError

__all__ = ["GPTConfig", "divisors", "partition_sizes", "stage_layer_counts", "padded_vocab_size", "PRESETS", "RECOMPUTE_GRANULARITIES",
           "LR_DECAY_STYLES", "POSITION_EMBEDDING_TYPES", "NORMALIZATIONS", "arch_fields", "pretrain_fields",
           "stage_parts", "group_ranges", "LLAMA", "option", "flag_of",
           "option_fields", "ROPE_SCALING_TYPES"]

# ----------------------------------------------------------------- declarations
# A declared field carries its flag, help and check in its metadata; GPTConfig declares the model's fields
# so, and tnlg.options the other options of tnlg pretrain. The argument parser, the config-file keys,
# the checkpoint's architecture record and the resume checks are read from the fields.

Check = Callable[[Any], Optional[str]]
"""A check of one value: ``None`` when valid, else the words after "must" (``"be a positive integer"``)."""


def option(default: Any, *, help: str = "", flags: tuple = (), choices: Optional[list] = None,
           metavar: Optional[str] = None, negative: Optional[str] = None, every: Optional[str] = None,
           cli: bool = True, must_match: bool = False, check: Optional[Check] = None, **extra):
    """A declared field.

    ``flags``: the command-line spellings (default ``--name-with-dashes``; the first is the one errors
    name); ``negative``: the flag that sets a boolean that defaults to True to False (``--no-plot``; with
    ``flags`` too, they set it True); ``every``: what ``--help`` says of a default that is not a plain
    value; ``cli=False``: settable in a config file only; ``must_match``: a resumed run must give the same
    value as the checkpoint (it defines the data); ``check``: the value's check (:data:`Check`).
    ``extra``: further metadata a declaration's readers use (:class:`tnlg.config.GPTConfig`: ``arch``,
    ``pretrain``, ``pretrain_default``, ``megatron``).
    """
    meta = dict(help=help, flags=flags, choices=choices, metavar=metavar, negative=negative, every=every, cli=cli,
                must_match=must_match, check=check, **extra)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(name: str) -> str:
    """``--name-with-dashes`` of a field ``name_with_underscores``."""
    return "--" + name.replace("_", "-")


def option_fields(cls) -> Iterator[dataclasses.Field]:
    """The option fields of a declared dataclass, in order."""
    return (f for f in dataclasses.fields(cls) if f.init)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(v) -> Optional[str]:
    return None if _is_int(v) and v > 0 else "be a positive integer"


def optional_positive_int(v) -> Optional[str]:
    return None if v is None or (_is_int(v) and v > 0) else "be a positive integer (or unset)"


def fraction(v) -> Optional[str]:
    """In ``[0, 1)`` (dropout rates)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < 1.0
    return None if ok else "be in [0, 1)"


def in_unit_interval(v) -> Optional[str]:
    """In ``(0, 1]`` (a share of something that must not be empty)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0
    return None if ok else "be in (0, 1]"


def positive(v) -> Optional[str]:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    return None if ok else "be a positive number"


def optional_positive(v) -> Optional[str]:
    return None if v is None or positive(v) is None else "be a positive number (or unset)"


def non_negative(v) -> Optional[str]:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
    return None if ok else "be a number >= 0"


def optional_non_negative(v) -> Optional[str]:
    return None if v is None or non_negative(v) is None else "be a number >= 0 (or unset)"


def boolean(v) -> Optional[str]:
    return None if isinstance(v, bool) else "be True or False"


def one_of(*values) -> Check:
    def check(v) -> Optional[str]:
        return None if v in values else f"be one of {', '.join(map(str, values))}"
    return check


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
    given = {0: first, stages - 1: last} if stages > 1 else {}
    fixed = {s: n for s, n in given.items() if n is not None}
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


ARCH: dict[str, Any] = dict(arch=True)           # recorded in checkpoints, compared on load
MODEL: dict[str, Any] = dict(arch=True, pretrain=True)  # ... and a ``tnlg pretrain`` model option
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
# rope's scalings, transformers' rope_type names (docs/llama.md: the inverse frequencies of each)
ROPE_SCALING_TYPES = ("none", "linear", "dynamic", "yarn", "llama3")
NO_MEGATRON: dict[str, Any] = dict(megatron="")  # a field no Megatron-LM argument carries (export: default only)
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
MOE_DROP_POLICIES = ("probs", "position")


def group_ranges(heads_per_rank: list[int], heads: int, groups: int) -> list[range]:
    """The key/value groups each TP rank's query heads use, a contiguous range per rank.

    Heads are split as :func:`partition_sizes` splits them; head ``i`` belongs to group
    ``i // (heads / groups)``. A rank holds every group one of its heads is in: with TP > groups a
    group is held by several ranks (a replicated slice), and where neither divides a rank may hold two
    (6 heads, 2 groups, TP 3: ranks hold groups [0], [0, 1], [1]).
    """
    per_group = heads // groups
    out, start = [], 0
    for n in heads_per_rank:
        out.append(range(start // per_group, (start + n - 1) // per_group + 1))
        start += n
    return out


def stage_parts(config: "GPTConfig", first: bool, last: bool) -> list[str]:
    """The modules besides transformer layers that a pipeline stage holds, by part name
    (:meth:`tnlg.model.DecoderBase.part`): the first the embeddings (``wte``, ``wpe`` with learned
    positions, ``drop``), the last ``ln_f`` and the LM head (``wte`` again when tied, else ``lm_head``),
    in the model's order. The whole model is the stage that is both."""
    tied = not config.untie_embeddings_and_output_weights
    held = {"wte": first or (last and tied), "wpe": first and config.position_embedding_type == "learned_absolute",
            "drop": first, "ln_f": last, "lm_head": last and not tied}
    return [name for name, here in held.items() if here]  # the model's order


def arch_fields() -> tuple[str, ...]:
    """The architecture fields of :class:`GPTConfig` (recorded in checkpoints, compared on load)."""
    return tuple(f.name for f in dataclasses.fields(GPTConfig) if f.metadata.get("arch"))


def pretrain_fields() -> list[dataclasses.Field]:
    """The fields of :class:`GPTConfig` that are ``tnlg pretrain`` model options."""
    return [f for f in dataclasses.fields(GPTConfig) if f.metadata.get("pretrain")]


@dataclass
class GPTConfig:
    """The decoder's hyper-parameters under Megatron-LM's names, each declared once (:func:`tnlg.fields.option`):
    its flag, help and check, whether it is architecture (``arch``: recorded in checkpoints, compared on
    load) and a ``tnlg pretrain`` model option (``pretrain``; ``pretrain_default`` where that run's default
    differs), and its Megatron-LM argument (``megatron``, default the field's name). ``tnlg pretrain``'s
    model options, ``--use-checkpoint-args``, the checkpoint's architecture record and the Megatron
    argument mapping are read from these declarations.

    The defaults are GPT-2's (and every earlier tnlg checkpoint's): learned positions, LayerNorm, GELU,
    full multi-head attention, biases. The Llama family: ``position_embedding_type="rope"`` (rotate-half
    rotary embeddings over the first ``rotary_percent`` of each head, base ``rotary_base``, no learned
    positions), ``normalization="RMSNorm"``, ``swiglu`` (the MLP ``silu(x W_gate) * (x W_up)``, then down),
    ``group_query_attention`` with ``num_query_groups`` KV heads, ``add_bias_linear=False`` (no linear
    biases; ``add_qkv_bias``: Qwen2's biases on QKV alone) and ``untie_embeddings_and_output_weights``.

    ``ffn_hidden_size`` defaults to ``4 * hidden_size`` (with ``swiglu``: Megatron's
    ``int(8 h / 3 / 64) * 64``); ``max_position_embeddings`` (default ``seq_length``) is the number of
    positions, part of the architecture, while ``seq_length`` (at most that) is how long the samples are, a
    training choice (Megatron's ``--max-position-embeddings`` and ``--seq-length``). ``init_method_std``
    initialises every matrix; the two residual output projections use ``std / sqrt(2 * num_layers)``
    (GPT-2 / Megatron scaled init).

    How the model runs, not what it is (a checkpoint may be resumed with other values):
    ``sequence_parallel`` splits the activations between the tensor-parallel regions along
    the sequence over the TP group (Korthikanti et al. 2022; no effect at TP 1);
    ``recompute_granularity`` is ``None`` (keep all activations), ``"selective"`` (recompute
    the attention core in backward) or ``"full"`` (recompute every block from its input).
    ``recompute_activations=True`` is the older spelling of ``"full"``.
    """

    num_layers: int = option(2, check=positive_int, pretrain_default=4, **MODEL)
    hidden_size: int = option(64, check=positive_int, pretrain_default=128, **MODEL)
    num_attention_heads: int = option(4, check=positive_int, pretrain_default=4, **MODEL)
    seq_length: int = option(64, check=positive_int, pretrain_default=128, must_match=True, pretrain=True,
                             help="tokens per sample: how the model is trained or evaluated, at most "
                             "--max-position-embeddings (a resumed run keeps it: it defines the samples)")
    max_position_embeddings: int = option(  # (given as None: seq_length's, set by __post_init__)
        None, check=optional_positive_int, every="--seq-length", help="the positions the model has: the rows of "
        "learned position embeddings, rope's max_position (transformers' max_position_embeddings, GPT-2's "
        "n_positions); any --seq-length up to it trains or evaluates the same model", **MODEL)
    vocab_size: int = option(256, check=positive_int, **ARCH)
    ffn_hidden_size: Optional[int] = option(None, check=optional_positive_int,
                                            every="4 x hidden size; with --swiglu int(8/3 x hidden / 64) x 64",
                                            **MODEL)
    hidden_dropout: float = option(0.0, check=fraction, pretrain_default=0.1, **MODEL)
    attention_dropout: float = option(0.0, check=fraction, pretrain_default=0.1, **MODEL)
    init_method_std: float = option(0.02, check=positive, pretrain=True)
    layernorm_epsilon: float = option(1e-5, check=positive, flags=("--norm-epsilon", "--layernorm-epsilon"),
                                      help="epsilon of every LayerNorm / RMSNorm", megatron="norm_epsilon",
                                      **MODEL)
    make_vocab_size_divisible_by: int = option(128, check=positive_int)
    recompute_activations: bool = option(False, check=boolean)
    seed: int = option(1234)
    sequence_parallel: bool = option(False, check=boolean)
    recompute_granularity: Optional[str] = option(None, check=one_of(*RECOMPUTE_GRANULARITIES))
    openai_gelu: bool = option(True, check=boolean, flags=("--openai-gelu",), negative="--no-openai-gelu",
                               help="GELU in tanh form (GPT-2's, tnlg's default); --no-openai-gelu: the exact "
                               "erf form, Megatron-LM's default", **MODEL)
    untie_embeddings_and_output_weights: bool = option(
        False, check=boolean, help="an output layer of its own instead of the word embedding (V x h more "
        "parameters)", **MODEL)
    position_embedding_type: str = option(
        "learned_absolute", check=one_of(*POSITION_EMBEDDING_TYPES), choices=list(POSITION_EMBEDDING_TYPES),
        help="learned_absolute: GPT-2's learned positions; rope: rotary embeddings on queries and keys "
        "(rotate-half, as transformers and Megatron-core); none: no positions", **MODEL)
    rotary_base: float = option(10000.0, check=positive, help="with rope: the base of the rotary angles "
                                "(transformers' rope_theta)", **MODEL)
    rotary_percent: float = option(1.0, check=in_unit_interval, help="with rope: the share of each head's "
                                   "dimensions rotated", **MODEL)
    rope_scaling_type: str = option("none", check=one_of(*ROPE_SCALING_TYPES), choices=list(ROPE_SCALING_TYPES),
                                    help="with rope: scaled rotary frequencies, transformers' rope_type (linear, "
                                    "dynamic, yarn, llama3: docs/llama.md); none: unscaled", **MODEL, **NO_MEGATRON)
    rope_scaling_factor: float = option(1.0, check=positive, help="with --rope-scaling-type: its factor",
                                        **MODEL, **NO_MEGATRON)
    rope_low_freq_factor: float = option(1.0, check=positive, help="llama3 rope: low_freq_factor", **MODEL,
                                         **NO_MEGATRON)
    rope_high_freq_factor: float = option(4.0, check=positive, help="llama3 rope: high_freq_factor", **MODEL,
                                          **NO_MEGATRON)
    rope_original_max_position: Optional[int] = option(
        None, check=optional_positive_int, every="--max-position-embeddings", help="llama3 and yarn rope: the "
        "pretraining length (original_max_position_embeddings)", **MODEL, **NO_MEGATRON)
    rope_beta_fast: float = option(32.0, check=positive, help="yarn rope: beta_fast", **MODEL, **NO_MEGATRON)
    rope_beta_slow: float = option(1.0, check=positive, help="yarn rope: beta_slow", **MODEL, **NO_MEGATRON)
    rope_mscale: Optional[float] = option(None, check=optional_positive, help="yarn rope: mscale", **MODEL,
                                          **NO_MEGATRON)
    rope_mscale_all_dim: Optional[float] = option(None, check=optional_positive, help="yarn rope: mscale_all_dim",
                                                  **MODEL, **NO_MEGATRON)
    rope_attention_factor: Optional[float] = option(
        None, check=optional_positive, every="from the factor (and mscale)", help="yarn rope: the factor on cos "
        "and sin (attention_factor)", **MODEL, **NO_MEGATRON)
    rope_truncate: bool = option(True, check=boolean, negative="--no-rope-truncate", help="yarn rope: round the "
                                 "correction range to whole dimensions (truncate)", **MODEL, **NO_MEGATRON)
    normalization: str = option("LayerNorm", check=one_of(*NORMALIZATIONS), choices=list(NORMALIZATIONS),
                                help="LayerNorm (GPT-2) or RMSNorm (Llama: no mean, no bias)", **MODEL)
    swiglu: bool = option(False, check=boolean, help="SwiGLU MLP: silu(x W_gate) * (x W_up), then the down "
                          "projection (three matrices; gate and up one column-parallel matmul)", **MODEL)
    group_query_attention: bool = option(False, check=boolean, help="grouped-query attention: "
                                         "--num-query-groups key/value heads shared by the query heads",
                                         **MODEL)
    num_query_groups: Optional[int] = option(None, check=optional_positive_int, help="with "
                                             "--group-query-attention: key/value heads (any tensor-parallel "
                                             "size works)", every="the head count", **MODEL)
    add_bias_linear: bool = option(True, check=boolean, negative="--disable-bias-linear",
                                   help="--disable-bias-linear: no bias in any linear layer (Llama)", **MODEL)
    add_qkv_bias: bool = option(False, check=boolean, help="biases on the query/key/value projections even "
                                "with --disable-bias-linear (Qwen2)", **MODEL)
    add_attn_bias: bool = option(False, check=boolean, help="biases on the query/key/value and attention output "
                                 "projections even with --disable-bias-linear (Llama's attention_bias)", **MODEL,
                                 **NO_MEGATRON)
    add_mlp_bias: bool = option(False, check=boolean, help="biases on the MLP's projections even with "
                                "--disable-bias-linear (Llama's mlp_bias)", **MODEL, **NO_MEGATRON)
    scale_attn_weights: bool = option(True, check=boolean, negative="--no-scale-attn-weights",
                                      help="divide the attention scores by sqrt(head_dim); "
                                      "--no-scale-attn-weights: no scaling (GPT-2's scale_attn_weights false)",
                                      **MODEL, **NO_MEGATRON)
    scale_attn_by_inverse_layer_idx: bool = option(False, check=boolean, help="divide layer i's attention "
                                                   "scores (0-based i) by i + 1 as well (GPT-2's field)", **MODEL,
                                                   **NO_MEGATRON)
    kv_channels: Optional[int] = option(None, check=optional_positive_int, every="hidden size / heads",
                                        help="the width of every attention head (transformers' head_dim): "
                                        "queries, keys and values are heads x kv-channels wide, which need not be "
                                        "the hidden size (Mistral-Nemo, Qwen3)", **MODEL)
    qk_layernorm: bool = option(False, check=boolean, help="normalise each head's queries and keys (the "
                                "--normalization kind over kv-channels, one weight shared by the heads) before "
                                "rope (Qwen3)", **MODEL)
    qk_layernorm_across_heads: bool = option(False, check=boolean, help="with --qk-layernorm: normalise the queries "
                                             "and the keys over every head at once (RMSNorm over the whole q and k "
                                             "projections, heads x kv-channels wide, one weight element each: OLMo 2, "
                                             "OLMoE) instead of each head", **MODEL, **NO_MEGATRON)
    sliding_window: Optional[int] = option(None, check=optional_positive_int, every="none: every earlier position",
                                           help="sliding-window attention: a query at position p attends to the "
                                           "keys p - w + 1 .. p (transformers' sliding_window w; Megatron's "
                                           "--window-size w-1 0)", **MODEL)
    window_layers: Optional[list[int]] = option(None, check=lambda v: None if v is None or (
        isinstance(v, list) and all(x in (0, 1) and not isinstance(x, bool) for x in v))
        else "be a list of 0 / 1 per layer (or unset)", every="every layer", metavar="0|1",
        help="with --sliding-window: 1 for each layer that slides, 0 for one that attends to every earlier "
        "position (Megatron's --window-attn-skip-freq list)", **MODEL)
    # ---- mixture of experts (megatron-core's names and semantics; docs/moe.md): Megatron-LM's arguments of the same
    # names carry them (tnlg.interop.megatron reads and writes them)
    num_experts: Optional[int] = option(None, check=optional_positive_int, every="none: every MLP is dense",
                                        help="routed experts of each mixture-of-experts layer (a decoder with "
                                        "experts: Mixtral, Qwen-MoE)", **MODEL)
    moe_router_topk: int = option(2, check=positive_int, help="with --num-experts: experts each token is sent to",
                                  **MODEL)
    moe_ffn_hidden_size: Optional[int] = option(None, check=optional_positive_int, every="--ffn-hidden-size",
                                                help="with --num-experts: each routed expert's MLP width", **MODEL)
    moe_shared_expert_intermediate_size: Optional[int] = option(
        None, check=optional_positive_int, every="none", help="with --num-experts: the width of the always-on "
        "shared expert (the shared experts' widths summed), run on every token beside the routed ones", **MODEL)
    moe_shared_expert_gate: bool = option(False, check=boolean, help="with a shared expert: scale its output by "
                                          "sigmoid(x w) per token (Qwen2-MoE's shared_expert_gate)", **MODEL)
    moe_layer_freq: Optional[list[int]] = option(
        None, check=lambda v: None if v is None or (_is_int(v) and v > 0) or (isinstance(v, list) and v and all(
            _is_int(x) and x >= 0 for x in v)) else "be a positive integer N (every N-th layer, from the first, is "
        "a mixture of experts) or a list of 0 / 1 per layer (or unset)", every="1: every layer", metavar="N|0|1",
        help="with --num-experts: which layers are mixtures of experts: one number N, every N-th layer from the "
        "first; or one 0 (dense) / 1 (experts) per layer (Megatron's list form; DeepSeek's first_k_dense_replace, "
        "Qwen's mlp_only_layers)", **MODEL)
    moe_router_pre_softmax: bool = option(False, check=boolean, help="softmax over all experts before the top-k "
                                          "(the k weights are then not renormalised: Qwen2-MoE's norm_topk_prob "
                                          "false); default: top-k of the logits, then softmax over the k (the "
                                          "weights sum to 1: Mixtral, Qwen3-MoE)", **MODEL)
    moe_router_score_function: str = option("softmax", check=one_of(*MOE_SCORE_FUNCTIONS),
                                            choices=list(MOE_SCORE_FUNCTIONS), help="the router's score: softmax, "
                                            "or sigmoid (DeepSeek-V3; the top-k scores renormalised)", **MODEL)
    moe_router_topk_scaling_factor: Optional[float] = option(
        None, check=optional_positive, every="none (1)", help="multiplies the k routing weights", **MODEL)
    moe_router_enable_expert_bias: bool = option(
        False, check=boolean, help="with the sigmoid score: a per-expert bias added to the scores for the top-k "
        "choice only, updated outside the gradient towards balanced loads (DeepSeek-V3's auxiliary-loss-free "
        "balancing)", **MODEL)
    moe_router_bias_update_rate: float = option(1e-3, check=positive, help="with --moe-router-enable-expert-bias: "
                                                "the bias's step per update", **MODEL)
    moe_router_load_balancing_type: str = option(
        "aux_loss", check=one_of(*MOE_BALANCING_TYPES), choices=list(MOE_BALANCING_TYPES),
        help="the load-balancing loss: aux_loss (Switch Transformer's, over the micro batch), seq_aux_loss (per "
        "sequence, averaged), none", **MODEL)
    moe_aux_loss_coeff: float = option(0.0, check=non_negative, help="the load-balancing loss's coefficient (0: "
                                       "off)", **MODEL)
    moe_z_loss_coeff: Optional[float] = option(None, check=optional_non_negative, every="none: off",
                                               help="the router z-loss's coefficient (ST-MoE)", **MODEL)
    moe_expert_capacity_factor: Optional[float] = option(
        None, check=optional_positive, every="none: dropless", help="each expert takes at most ceil(tokens x top-k "
        "/ experts x factor) tokens of a micro batch; the rest of its tokens are dropped (megatron-core's rule)",
        **MODEL)
    moe_pad_expert_input_to_capacity: bool = option(False, check=boolean, help="with a capacity factor: every "
                                                    "expert runs exactly its capacity of tokens", **MODEL)
    moe_token_drop_policy: str = option("probs", check=one_of(*MOE_DROP_POLICIES), choices=list(MOE_DROP_POLICIES),
                                        help="with a capacity factor: which tokens an expert keeps: those of the "
                                        "highest routing weight (probs) or the first ones (position)", **MODEL)

    def __post_init__(self):
        if isinstance(self.window_layers, tuple):  # (GPT.describe keys its cache by a tuple of the fields)
            self.window_layers = list(self.window_layers)
        if isinstance(self.moe_layer_freq, tuple):
            self.moe_layer_freq = list(self.moe_layer_freq)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
                                    and isinstance(self.hidden_size, int) and self.hidden_size >= 48
                                    else 4 * self.hidden_size)
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            wrong = check(getattr(self, f.name)) if check else None
            if wrong:
                raise ValueError(f"GPTConfig.{f.name} must {wrong}, got {getattr(self, f.name)!r}.")
        if self.max_position_embeddings is None and isinstance(self.seq_length, int):
            self.max_position_embeddings = self.seq_length
        self._check_shape()
        self._check_qk_norm()
        self._check_window()
        self._check_experts()
        if isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int) and \
                self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            self.kv_channels = None  # the default width, written one way (configs that compute alike compare equal)
        if self.recompute_activations and self.recompute_granularity == "selective":
            raise ValueError("GPTConfig.recompute_activations=True means full recomputation (every block), which "
                             "contradicts recompute_granularity='selective' (the attention core only); set one "
                             "of them.")

    def _check_shape(self) -> None:
        """The checks across fields: the samples fit the positions, heads divide the width, groups divide the
        heads, rope's share."""
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"seq_length={self.seq_length} (--seq-length) is longer than the model's "
                             f"max_position_embeddings={self.max_position_embeddings} positions "
                             f"(--max-position-embeddings): a sample must fit the positions the model has. Give "
                             f"--seq-length {self.max_position_embeddings} or less (or, for a new model, a larger "
                             f"--max-position-embeddings).")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            near = sorted(divisors(self.hidden_size), key=lambda d: abs(d - self.num_attention_heads))[:4]
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: every head needs the same width. Head counts that "
                f"divide {self.hidden_size} near {self.num_attention_heads}: {sorted(near)}; or give the head width "
                f"itself (kv_channels, --kv-channels).")
        heads, groups = self.num_attention_heads, self.num_query_groups
        if groups is not None and not self.group_query_attention:
            raise ValueError(f"num_query_groups={groups} (--num-query-groups) is given without "
                             "group_query_attention (--group-query-attention): give both, as in Megatron-LM.")
        if self.group_query_attention and groups is None:
            raise ValueError("group_query_attention (--group-query-attention) needs num_query_groups "
                             "(--num-query-groups G, the key/value heads).")
        if groups is not None and heads % groups:
            raise ValueError(f"num_query_groups={groups} (--num-query-groups) does not divide "
                             f"num_attention_heads={heads}: every group serves the same number of query heads. "
                             f"Valid group counts for {heads} heads: {divisors(heads)}.")
        if self.position_embedding_type != "rope" and (self.rotary_base != 10000.0 or self.rotary_percent != 1.0):
            raise ValueError(f"rotary_base={self.rotary_base} / rotary_percent={self.rotary_percent} "
                             f"(--rotary-base / --rotary-percent) set rotary embeddings, but "
                             f"position_embedding_type={self.position_embedding_type!r}; give "
                             "--position-embedding-type rope with them, or drop them.")
        self._check_rope_scaling()
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"rotary_percent={self.rotary_percent} of head_dim={self.head_dim} rotates "
                             f"{self.head_dim * self.rotary_percent:g} dimensions; rope needs an even number "
                             "of at least 2 (rotate-half pairs dimension i with i + rotated / 2).")

    _ROPE_SCALING_FIELDS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                            "rope_original_max_position", "rope_beta_fast", "rope_beta_slow", "rope_mscale",
                            "rope_mscale_all_dim", "rope_attention_factor", "rope_truncate")

    def _check_rope_scaling(self) -> None:
        """A scaling needs rope; its fields need a scaling; llama3's two frequency factors must differ."""
        kind = self.rope_scaling_type
        given = [f.name for f in dataclasses.fields(self) if f.name in self._ROPE_SCALING_FIELDS
                 and getattr(self, f.name) != f.default]
        if kind != "none" and self.position_embedding_type != "rope":
            raise ValueError(f"rope_scaling_type={kind!r} (--rope-scaling-type) scales rotary embeddings, but "
                             f"position_embedding_type={self.position_embedding_type!r}; give "
                             "--position-embedding-type rope with it, or drop it.")
        if kind == "none" and given:
            raise ValueError(f"{', '.join(given)} set a rope scaling, but rope_scaling_type is 'none'; give "
                             f"--rope-scaling-type (one of {', '.join(ROPE_SCALING_TYPES[1:])}) with them, or drop "
                             "them.")
        if kind == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"llama3 rope needs rope_high_freq_factor ({self.rope_high_freq_factor}) greater than "
                             f"rope_low_freq_factor ({self.rope_low_freq_factor}): the frequencies between the two "
                             "wavelengths are interpolated.")

    @property
    def rope_scaling(self) -> Optional[dict]:
        """The rope scaling :mod:`tnlg.parallel.rotary` computes (``None``: unscaled): its ``type`` and
        parameters, the original length resolved (default ``max_position_embeddings``, as transformers'),
        and ``max_position`` (``max_position_embeddings``, transformers' own)."""
        if self.position_embedding_type != "rope" or self.rope_scaling_type == "none":
            return None
        return dict(type=self.rope_scaling_type, factor=self.rope_scaling_factor,
                    low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                    original_max_position=self.rope_original_max_position or self.max_position_embeddings,
                    beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow, mscale=self.rope_mscale,
                    mscale_all_dim=self.rope_mscale_all_dim, attention_factor=self.rope_attention_factor,
                    truncate=self.rope_truncate, max_position=self.max_position_embeddings)

    def attention_score_scale(self, layer: int) -> float:
        """What layer ``layer`` (0-based) multiplies its attention scores by on top of ``1 / sqrt(head_dim)``:
        ``sqrt(head_dim)`` without ``scale_attn_weights`` (no scaling at all), divided by ``layer + 1`` with
        ``scale_attn_by_inverse_layer_idx`` (GPT-2's two fields); 1.0 for every other model."""
        scale = 1.0 if self.scale_attn_weights else math.sqrt(self.head_dim)
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

    @property
    def attn_out_bias(self) -> bool:
        """Whether the attention output projection has a bias."""
        return self.add_bias_linear or self.add_attn_bias

    @property
    def mlp_biases(self) -> bool:
        """Whether the MLP's projections have biases."""
        return self.add_bias_linear or self.add_mlp_bias
    def _check_qk_norm(self) -> None:
        """The QK norm over every head at once needs the QK norm, and is an RMSNorm."""
        if self.qk_layernorm_across_heads and not (self.qk_layernorm and self.normalization == "RMSNorm"):
            raise ValueError(f"qk_layernorm_across_heads (--qk-layernorm-across-heads) normalises the queries and "
                             f"keys over every head with an RMSNorm, but qk_layernorm={self.qk_layernorm} and "
                             f"normalization={self.normalization!r}: give --qk-layernorm --normalization RMSNorm with "
                             "it, or drop it.")

    def _check_window(self) -> None:
        """The sliding window's layers: one entry per layer, and only with a window."""
        layers = self.window_layers
        if layers is not None and self.sliding_window is None:
            raise ValueError(f"window_layers={layers} (--window-layers) is given without sliding_window "
                             "(--sliding-window W): give the window, or drop the layer list.")
        if layers is not None and len(layers) != self.num_layers:
            raise ValueError(f"window_layers (--window-layers) has {len(layers)} entries for num_layers={self.num_layers}: give one "
                             "0 (full attention) or 1 (sliding) per layer.")

    _MOE_FIELDS = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                   "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function",
                   "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_aux_loss_coeff",
                   "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity")

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: they need ``num_experts``; top-k at most the experts; a layer list
        of one 0 / 1 per layer; the gate needs a shared expert; padding needs a capacity; the expert bias
        needs the sigmoid score (as megatron-core's ``TransformerConfig`` checks)."""
        if isinstance(self.moe_layer_freq, int) and not isinstance(self.moe_layer_freq, bool):
            self.moe_layer_freq = [self.moe_layer_freq]
        E, k = self.num_experts, self.moe_router_topk
        if E is None:
            given = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                     if f.name in self._MOE_FIELDS and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{', '.join(given)} configure mixture-of-experts layers, but num_experts "
                                 "(--num-experts E) is not set, so every MLP is dense; give --num-experts, or drop "
                                 "them.")
            return
        if k > E:
            raise ValueError(f"moe_router_topk={k} (--moe-router-topk) is more than num_experts={E} "
                             f"(--num-experts): each token is sent to k different experts. Valid top-k: 1 to {E}.")
        if self.mlp_biases:
            raise ValueError("num_experts (--num-experts) with biases in the MLP (add_bias_linear or add_mlp_bias): "
                             "tnlg's experts have no biases (Mixtral, Qwen-MoE and OLMoE have none); give "
                             "--disable-bias-linear (and no --add-mlp-bias) with --num-experts.")
        freq = self.moe_layer_freq
        if freq is not None and len(freq) == 1 and freq[0] < 1:
            raise ValueError(f"moe_layer_freq={freq[0]} (--moe-layer-freq): one number N makes every N-th layer a "
                             "mixture of experts and must be at least 1; give one 0 / 1 per layer for a pattern.")
        if freq is not None and len(freq) > 1 and (len(freq) != self.num_layers or any(x not in (0, 1) for x in freq)):
            raise ValueError(f"moe_layer_freq={freq} (--moe-layer-freq) has {len(freq)} entries for num_layers="
                             f"{self.num_layers}: a pattern gives one 0 (dense MLP) or 1 (experts) per layer; or give "
                             "one number N (every N-th layer).")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ValueError("moe_shared_expert_gate (--moe-shared-expert-gate) gates the shared expert, but "
                             "moe_shared_expert_intermediate_size (--moe-shared-expert-intermediate-size) is not "
                             "set: give the shared expert's width, or drop the gate.")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity (--moe-pad-expert-input-to-capacity) pads every "
                             "expert to its capacity, but there is no moe_expert_capacity_factor "
                             "(--moe-expert-capacity-factor C): give the factor, or drop the padding.")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias (--moe-router-enable-expert-bias) is DeepSeek-V3's "
                             "balancing of sigmoid scores; give --moe-router-score-function sigmoid with it (as "
                             "megatron-core requires), or drop it.")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a mixture of experts (``num_experts`` and ``moe_layer_freq``:
        every N-th layer from the first, or the 0 / 1 pattern)."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq or [1]
        return layer % freq[0] == 0 if len(freq) == 1 else bool(freq[layer])

    @property
    def num_moe_layers(self) -> int:
        """How many layers are mixtures of experts."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each routed expert's width: ``moe_ffn_hidden_size``, else ``ffn_hidden_size``."""
        assert self.ffn_hidden_size is not None  # __post_init__ sets it
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def check_expert_parallel(self, ep: int) -> None:
        """A ``ValueError`` naming the valid sizes unless ``ep`` experts-parallel ranks split the experts evenly."""
        E = self.num_experts
        if ep == 1:
            return
        if E is None:
            raise ValueError(f"expert-parallel size {ep} (--expert-model-parallel-size) splits the experts of a "
                             "mixture of experts, but the model has none (--num-experts is not set); use 1.")
        if E % ep:
            raise ValueError(f"expert-parallel size {ep} (--expert-model-parallel-size) does not divide num_experts="
                             f"{E}: every expert-parallel rank holds the same number of experts. Valid sizes: "
                             f"{divisors(E)}.")

    def moe_mlp_parameters(self, tp: int = 1, tp_rank: int = 0, ep: int = 1, active: bool = False) -> int:
        """One MoE layer's experts on TP rank ``tp_rank`` of ``tp`` and an EP rank of ``ep``: the ``E / ep``
        routed experts (or, ``active``, the top-k a token runs) and the shared expert, each an MLP of
        ``mats f h + f h`` with ``f`` split over TP (the router and the gate are replicated:
        :meth:`moe_replicated_parameters`)."""
        assert self.num_experts is not None
        h, mats = self.hidden_size, (2 if self.swiglu else 1)
        shared = self.moe_shared_expert_intermediate_size
        routed = self.routed_expert_parameters(tp, tp_rank, ep)
        if active:
            routed = routed * ep // self.num_experts * self.moe_router_topk
        return routed + ((mats + 1) * partition_sizes(shared, tp)[tp_rank] * h if shared else 0)

    def routed_expert_parameters(self, tp: int = 1, tp_rank: int = 0, ep: int = 1) -> int:
        """One MoE layer's routed experts on TP rank ``tp_rank`` of ``tp`` and an EP rank of ``ep``: ``E / ep``
        MLPs of ``mats f_r h + f_r h`` (``f_r`` this rank's columns of ``--moe-ffn-hidden-size``), the parameters
        of gradient kind ``"expert"`` (reduced over the expert-data-parallel ranks)."""
        assert self.num_experts is not None
        mats = 2 if self.swiglu else 1
        return self.num_experts // ep * (mats + 1) * partition_sizes(self.expert_ffn_hidden_size, tp)[tp_rank] * \
            self.hidden_size

    def moe_replicated_parameters(self) -> int:
        """One MoE layer's parameters every TP and EP rank holds: the router ``E h`` and the shared expert's
        gate ``h``."""
        if self.num_experts is None:
            return 0
        return (self.num_experts + (1 if self.moe_shared_expert_gate else 0)) * self.hidden_size

    def active_parameters(self) -> int:
        """Parameters one token runs through: every dense part, and in each MoE layer the router, the shared
        expert and top-k routed experts (Mixtral 8x7B: 12.9B of 46.7B; without experts, every parameter)."""
        total = self.num_parameters_formula()
        if self.num_experts is None:
            return total
        return total - self.num_moe_layers * (self.moe_mlp_parameters() - self.moe_mlp_parameters(active=True))

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of layer ``layer`` (0-based): ``sliding_window`` where it slides, else ``None``
        (every earlier position)."""
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[layer]):
            return None
        return self.sliding_window

    @property
    def attention_width(self) -> int:
        """The queries' (and the attention output's) width, ``heads x head_dim``: the hidden size unless
        ``kv_channels`` sets another head width."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_groups(self) -> int:
        """Key/value heads: ``num_query_groups`` with grouped-query attention, else one per head."""
        if self.group_query_attention:
            assert self.num_query_groups is not None  # __post_init__ refuses GQA without it
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that rope rotates (Megatron: ``int(head_dim * rotary_percent)``)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        """Whether the query/key/value projections have biases."""
        return self.add_bias_linear or self.add_qkv_bias or self.add_attn_bias

    @property
    def effective_recompute_granularity(self) -> Optional[str]:
        """``"full"``, ``"selective"`` or ``None``: ``recompute_granularity``, else ``"full"`` when
        ``recompute_activations`` is set."""
        return self.recompute_granularity or ("full" if self.recompute_activations else None)

    @property
    def head_dim(self) -> int:
        """The width of one head: ``kv_channels``, else ``hidden_size / num_attention_heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def max_tensor_parallel_size(self) -> int:
        """Largest TP the model allows: every rank needs at least one head (and one MLP column)."""
        assert self.ffn_hidden_size is not None  # __post_init__ sets it
        return min(self.num_attention_heads, self.ffn_hidden_size)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise a ``ValueError`` naming the largest valid TP when ``tp`` cannot split this model."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}.")
        assert self.ffn_hidden_size is not None  # __post_init__ sets it
        if tp > self.num_attention_heads:
            raise ValueError(
                f"tensor-parallel size {tp} is larger than num_attention_heads={self.num_attention_heads}: "
                f"every rank needs at least one whole head. The largest valid tensor-parallel size for "
                f"attention is {self.num_attention_heads} (heads are split as evenly as possible, so "
                f"any size from 1 to {self.num_attention_heads} works).")
        if tp > self.ffn_hidden_size:
            what = " (--ffn-hidden-size: with --swiglu the width of each of the gate and up projections, whose " \
                   "columns a rank holds in pairs)" if self.swiglu else " (--ffn-hidden-size)"
            raise ValueError(f"tensor-parallel size {tp} is larger than ffn_hidden_size={self.ffn_hidden_size}{what}: "
                             f"every rank needs at least one MLP column. The largest valid tensor-parallel size is "
                             f"{self.max_tensor_parallel_size()}; or give an --ffn-hidden-size of at least {tp}.")

    def heads_per_rank(self, tp: int) -> list[int]:
        self.check_tensor_parallel(tp)
        return partition_sizes(self.num_attention_heads, tp)

    def ffn_per_rank(self, tp: int) -> list[int]:
        self.check_tensor_parallel(tp)
        assert self.ffn_hidden_size is not None  # __post_init__ sets it
        return partition_sizes(self.ffn_hidden_size, tp)

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp, self.make_vocab_size_divisible_by)

    def num_parameters_formula(self, vocab_size: Optional[int] = None, final_layernorm: bool = True) -> int:
        """Narayanan et al. 2021 eq. 2, generalised to any ffn width:
        ``l (4h^2 + 2 h f + 9h + f) + (V + s) h`` (+ 2h for the final LayerNorm; + V h for an
        untied output layer).
        With f = 4h this is ``12 l h^2 + 13 l h + (V + s) h``. The Llama family (RMSNorm, rope, SwiGLU,
        ``a`` heads and ``G`` KV groups of width ``d``, no biases, untied): ``l (2 a d h + 2 G d h + 3 h f + 2h) + 2 V h + h``
        (``a d = h`` unless ``kv_channels`` sets ``d``; ``qk_layernorm`` adds ``2 d`` per layer).
        (The TP=1 case of :meth:`parameters_per_rank`.)"""
        total = self.parameters_per_rank(1, vocab_size)[0]["params_unpadded"]
        return total - (0 if final_layernorm else self.norm_parameters())

    def kv_groups_per_rank(self, tp: int) -> list[range]:
        """Every TP rank's key/value groups (:func:`group_ranges`); one group per head without GQA."""
        return group_ranges(self.heads_per_rank(tp), self.num_attention_heads, self.kv_groups)

    def norm_parameters(self) -> int:
        """Parameters of one normalisation: LayerNorm's weight and bias, RMSNorm's weight."""
        return (1 if self.normalization == "RMSNorm" else 2) * self.hidden_size

    def qk_norm_parameters(self) -> int:
        """Parameters of one layer's query and key norms (``qk_layernorm``): two norms of ``head_dim``, or with
        ``qk_layernorm_across_heads`` the whole projections' (``heads x head_dim`` and ``groups x head_dim``)."""
        if not self.qk_layernorm:
            return 0
        if self.qk_layernorm_across_heads:
            return (self.num_attention_heads + self.kv_groups) * self.head_dim
        return 2 * (1 if self.normalization == "RMSNorm" else 2) * self.head_dim

    def replicated_parameters(self) -> int:
        """Parameters every TP rank holds in full: per layer two norms and (with biases) the two row-parallel
        biases, the query and key norms (``qk_layernorm``: :meth:`qk_norm_parameters`), the learned position embedding
        ``s h`` (if any; ``s`` the positions, ``max_position_embeddings``), each MoE layer's router and shared-expert
        gate, and the final norm. GPT-2:
        ``l (2h + h + 2h + h) + s h + 2h``."""
        l, h, s = self.num_layers, self.hidden_size, self.max_position_embeddings
        per_layer = (2 * self.norm_parameters() + (h if self.attn_out_bias else 0) + (h if self.mlp_biases else 0)
                     + self.qk_norm_parameters())
        positions = s * h if self.position_embedding_type == "learned_absolute" else 0
        return l * per_layer + self.num_moe_layers * self.moe_replicated_parameters() + positions + \
            self.norm_parameters()

    def parameters_per_rank(self, tp: int, vocab_size: Optional[int] = None) -> list[dict]:
        """Closed-form parameter count of each TP rank's shard (the one parameter-count formula).

        Each entry: ``params`` (including padded vocabulary rows), ``params_unpadded``
        and ``replicated`` (:meth:`replicated_parameters`). Split over TP: the queries (whole heads per
        rank), the keys and values (the rank's heads', or with grouped-query attention the rank's KV groups,
        :meth:`kv_groups_per_rank`: a group shared by several ranks is counted on each), their biases, the
        attention output weight, the MLP's fc (two matrices with SwiGLU; its bias) and proj weight (a
        mixture-of-experts layer's experts instead, :meth:`moe_mlp_parameters`, all ``E`` of them), and the
        word embedding (vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``, split
        evenly; an untied output layer splits the same way and doubles that term). Summed over ranks,
        ``params_unpadded`` is :meth:`num_parameters_formula` plus ``replicated * (tp - 1)`` (plus the
        copies of shared KV groups).
        """
        l, h, d = self.num_layers, self.hidden_size, self.head_dim
        vocab = self.vocab_size if vocab_size is None else vocab_size
        shard_rows = padded_vocab_size(vocab, tp, self.make_vocab_size_divisible_by) // tp
        replicated = self.replicated_parameters()
        tables = 2 if self.untie_embeddings_and_output_weights else 1  # embedding (+ output layer)
        mats, bias = (2 if self.swiglu else 1), (1 if self.mlp_biases else 0)
        out = []
        for r, (heads, groups, ffn) in enumerate(zip(self.heads_per_rank(tp), self.kv_groups_per_rank(tp),
                                                     self.ffn_per_rank(tp))):
            width = heads * d
            qkv_rows = width + (2 * heads * d if self.kv_groups == self.num_attention_heads
                                else 2 * len(groups) * d)  # (width: heads x head_dim, not always h / tp)
            attn = qkv_rows * h + (qkv_rows if self.qkv_bias else 0) + width * h
            mlp = mats * ffn * h + bias * mats * ffn + ffn * h
            moe = self.num_moe_layers
            sharded = l * attn + (l - moe) * mlp + (moe * self.moe_mlp_parameters(tp, r) if moe else 0)
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
# what makes a decoder Llama's (the fields every Llama-family preset shares)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)

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
    # the Llama family: rope, RMSNorm, SwiGLU, no biases, untied output layer (Touvron et al. 2023; Meta's
    # published configurations); a CPU-sized one for the built-in job, with grouped-query attention
    "llama-tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=2000,
                       group_query_attention=True, num_query_groups=2, **LLAMA),
    "llama2-7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000,
                      ffn_hidden_size=11008, **LLAMA),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=8192,
                      vocab_size=128256, ffn_hidden_size=14336, group_query_attention=True, num_query_groups=8,
                      **{**LLAMA, "rotary_base": 500000.0}),
    # mixtures of experts (docs/moe.md): Mistral's and Qwen's published configurations (46.7B total, 12.9B
    # active; 30.5B total, 3.3B active)
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=32768, vocab_size=32000,
                         ffn_hidden_size=14336, group_query_attention=True, num_query_groups=8, num_experts=8,
                         moe_router_topk=2, **{**LLAMA, "rotary_base": 1000000.0}),
    "qwen3-30b-a3b": dict(num_layers=48, hidden_size=2048, num_attention_heads=32, kv_channels=128, qk_layernorm=True,
                          seq_length=40960, vocab_size=151936, ffn_hidden_size=6144, moe_ffn_hidden_size=768,
                          group_query_attention=True, num_query_groups=4, num_experts=128, moe_router_topk=8,
                          layernorm_epsilon=1e-6, **{**LLAMA, "rotary_base": 1000000.0}),
}
