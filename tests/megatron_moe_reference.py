"""megatron-core's mixture of experts as the reference for Megatron MoE checkpoint conversion (tests/test_megatron_moe.py).

Spawned gloo workers (world = TP x EP: the EP ranks are the data-parallel ranks, one expert-data-parallel rank)
build megatron-core's ``GPTModel`` with ``num_moe_experts`` (``get_gpt_decoder_block_spec(config,
use_transformer_engine=False)``: the local spec per layer, a dense one where ``moe_layer_freq`` says, ``SequentialMLP``
experts, the ``allgather`` token dispatcher), compute its logits with
Megatron's forward and save each rank's ``state_dict_for_save_checkpoint()`` in Megatron-LM's legacy layout
(``iter_N/mp_rank_TT[_EEE]/model_optim_rng.pt``, written by expert-data-parallel rank 0 of every TP x EP rank, as
``get_checkpoint_name(..., expert_parallel=True)`` names them). The legacy ``GroupedMLP`` layout comes from
megatron-core itself: the ``SequentialMLP`` model's ``torch_dist`` save (``dist_checkpointing.save``) is loaded into
a ``GroupedMLP`` model's ``sharded_state_dict`` (megatron-core's documented compatibility of the two), whose own
state dict is then saved; ``GroupedMLP`` runs only with the ``grouped_gemm`` CUDA package and bf16, so it is built
(``assert_grouped_gemm_is_available`` passed) but never run: the ``SequentialMLP`` model's logits are the reference
of both. The other way, :func:`load_and_run` loads a tnlg export into ``GPTModel`` and returns its logits.

Besides :mod:`tests.megatron_reference`'s replacements of CUDA-only calls, megatron-core 0.16.1's router calls a
name (``te_general_gemm``) it imports only with Transformer Engine: it is set to ``None`` (its plain-torch path).
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist

from . import megatron_reference as R


def _patch() -> None:
    R._patch_cuda_calls()
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as mu
    mu.te_general_gemm = None
    gg.assert_grouped_gemm_is_available = lambda: None


def _leave() -> None:
    """:func:`megatron_reference._leave` (dist_checkpointing's writer processes ended), and the queue of the Manager
    process its torch_dist writer started forgotten, so that a later save in the same call starts a new one."""
    R._leave()
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    writer._results_queue = None


def moe_args(spec: dict) -> argparse.Namespace:
    """The saved args of a Megatron-LM MoE run of ``spec`` (:func:`megatron_reference.megatron_args` plus
    ``--num-experts --moe-router-topk --moe-ffn-hidden-size ...`` and ``--expert-model-parallel-size``)."""
    m = spec["moe"]
    args = R.megatron_args(spec)
    if not spec.get("llama"):
        args.add_bias_linear = False
    for k, v in dict(num_experts=m["experts"], moe_router_topk=m["topk"], moe_ffn_hidden_size=m["ffn"],
                     moe_shared_expert_intermediate_size=m.get("shared"), moe_shared_expert_gate=m.get("gate", False),
                     moe_layer_freq=m.get("freq", 1), moe_router_pre_softmax=m.get("pre_softmax", False),
                     moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
                     moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=None,
                     moe_grouped_gemm=bool(spec.get("grouped")), moe_use_legacy_grouped_gemm=bool(spec.get("grouped")),
                     moe_token_dispatcher_type="allgather", expert_model_parallel_size=spec["ep"],
                     expert_tensor_parallel_size=spec["tp"], world_size=spec["tp"] * spec["ep"],
                     data_parallel_size=spec["ep"]).items():
        setattr(args, k, v)
    return args


def build_model(spec: dict, grouped: bool = False):
    """megatron-core's GPTModel of ``spec`` with mixture-of-experts layers (``grouped``: the legacy GroupedMLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    m = spec["moe"]
    base = R._config(spec)
    kw = {f: getattr(base, f) for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                        "hidden_dropout", "attention_dropout", "layernorm_epsilon", "normalization",
                                        "gated_linear_unit", "activation_func", "num_query_groups", "add_qkv_bias",
                                        "tensor_model_parallel_size")}
    config = TransformerConfig(
        **kw, use_cpu_initialization=True, add_bias_linear=False, bias_activation_fusion=False,
        pipeline_dtype=torch.float32, num_moe_experts=m["experts"], moe_router_topk=m["topk"],
        moe_ffn_hidden_size=m["ffn"], moe_shared_expert_intermediate_size=m.get("shared"),
        moe_shared_expert_gate=m.get("gate", False), moe_layer_freq=m.get("freq", 1),
        moe_router_pre_softmax=m.get("pre_softmax", False), moe_grouped_gemm=grouped,
        moe_use_legacy_grouped_gemm=grouped, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=spec["ep"], expert_tensor_parallel_size=spec["tp"])
    ll = spec.get("llama")
    rope = dict(position_embedding_type="rope", rotary_base=ll["rotary_base"],
                rotary_percent=ll["rotary_percent"]) if ll else {}
    # the block spec (the local spec per layer, dense where moe_layer_freq says so), as Megatron-LM builds an MoE run
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                            normalization="RMSNorm" if ll else None)
    torch.manual_seed(1234)
    return GPTModel(config, block_spec, vocab_size=R.padded(spec), max_sequence_length=spec["seq"],
                    share_embeddings_and_output_weights=not spec["untie"], **rope)


@torch.no_grad()
def _perturb(model, tp_rank: int, ep_rank: int) -> None:
    """Deterministic noise on every weight: the same on every rank for a replicated one, per TP rank for a
    TP shard, per EP rank too for an expert's (so that no two experts are alike); the routers scaled up so that
    no token's top-k is a near tie."""
    for name, p in model.named_parameters():
        sharded = getattr(p, "tensor_model_parallel", False)
        expert = ".experts." in name
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * tp_rank if sharded else 0)
                                          + (100000 * ep_rank if expert else 0))
        p.add_(0.1 * torch.randn(p.shape, generator=g))
        if name.endswith("router.weight"):
            p.mul_(20.0)


def _init(spec: dict) -> None:
    _patch()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec["tp"],
                                             expert_model_parallel_size=spec["ep"],
                                             expert_tensor_parallel_size=spec["tp"])


def _ranks() -> tuple[int, int]:
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()


def _save_legacy(model, spec: dict, root: str, grouped: bool) -> None:
    t, e = _ranks()
    name = "mp_rank_%02d" % t + ("_%03d" % e if spec["ep"] > 1 else "")
    path = os.path.join(root, "iter_0000007", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(args=moe_args(dict(spec, grouped=grouped)), checkpoint_version=3.0, iteration=7,
                    model=model.state_dict_for_save_checkpoint()), path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")


def save_reference(ps, spec: dict, root: str, tokens: torch.Tensor):
    """Worker (world = TP x EP): the SequentialMLP model's logits, its legacy files (``root/sequential``) and the
    GroupedMLP model's (``root/grouped``, its weights loaded by megatron-core from the SequentialMLP model's
    ``torch_dist`` save); returns the logits, and how many of this rank's GroupedMLP tensors hold weights."""
    _init(spec)
    from megatron.core import dist_checkpointing
    model = build_model(spec)
    _perturb(model, *_ranks())
    logits = R.logits_of(model, spec, tokens)
    _save_legacy(model, spec, os.path.join(root, "sequential"), grouped=False)
    for fmt, metadata in (("torch_dist", None), ("torch_dist_singleton", dict(singleton_local_shards=True))):
        folder = os.path.join(root, fmt, "iter_0000007")
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(dict(args=moe_args(spec), checkpoint_version=3.0, iteration=7,
                                     model=model.sharded_state_dict(metadata=metadata)), folder)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(root, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
    dist_dir = os.path.join(root, "torch_dist", "iter_0000007")
    grouped = build_model(spec, grouped=True)
    loaded = dist_checkpointing.load(dict(model=grouped.sharded_state_dict()), dist_dir)
    grouped.load_state_dict(loaded["model"], strict=True)
    _save_legacy(grouped, spec, os.path.join(root, "grouped"), grouped=True)
    _leave()
    weights = [n for n in grouped.state_dict() if n.endswith(("experts.weight1", "experts.weight2"))]
    return dict(logits=logits, grouped_tensors=len(weights))


def load_and_run(ps, spec: dict, root: str, tokens: torch.Tensor, fmt: str = "legacy", grouped: bool = False):
    """Worker (world = TP x EP): a tnlg export loaded into GPTModel per TP x EP rank, by ``load_state_dict``
    (strict) of its legacy files or by ``dist_checkpointing.load`` of its ``torch_dist`` store; returns the logits
    and the saved args' MoE fields. ``grouped``: the legacy files hold ``GroupedMLP`` weights, loaded (strict) into
    a ``GroupedMLP`` model, which cannot run here: megatron-core converts it to the ``SequentialMLP`` model that
    gives the logits (``dist_checkpointing.save`` of the one, ``load`` into the other's ``sharded_state_dict``)."""
    _init(spec)
    from megatron.core import dist_checkpointing
    t, e = _ranks()
    it_dir = os.path.join(root, "iter_0000007")
    if fmt == "torch_dist":
        model = build_model(spec)
        loaded = dist_checkpointing.load(dict(model=model.sharded_state_dict()), it_dir)
        model.load_state_dict(loaded["model"], strict=True)
        common = dist_checkpointing.load_common_state_dict(it_dir)
        _leave()
    else:
        name = "mp_rank_%02d" % t + ("_%03d" % e if spec["ep"] > 1 else "")
        common = torch.load(os.path.join(it_dir, name, "model_optim_rng.pt"), weights_only=False)
        model = build_model(spec, grouped=grouped)
        model.load_state_dict(common["model"], strict=True)
        if grouped:
            via = os.path.join(root + "_via_torch_dist")
            if dist.get_rank() == 0:
                os.makedirs(via, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(dict(model=model.sharded_state_dict()), via)
            dist.barrier()
            model = build_model(spec)
            model.load_state_dict(dist_checkpointing.load(dict(model=model.sharded_state_dict()), via)["model"],
                                  strict=True)
            _leave()
    args = vars(common["args"])
    keys = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_layer_freq", "moe_router_pre_softmax", "expert_model_parallel_size",
            "moe_grouped_gemm", "moe_use_legacy_grouped_gemm")
    return dict(logits=R.logits_of(model, spec, tokens), args={k: args.get(k) for k in keys})
