"""megatron-core itself as the reference for Megatron checkpoint conversion (used by test_megatron_*).

Spawned gloo workers build megatron-core's ``GPTModel`` (local layer spec, ``use_cpu_initialization``)
at TP x PP with random weights, compute its logits with Megatron's forward, and save it with
Megatron's own code: ``dist_checkpointing.save`` of ``{"model": model.sharded_state_dict(), "args",
"checkpoint_version", "iteration"}`` (``torch_dist``) and ``torch.save`` of the same entries with
``model.state_dict_for_save_checkpoint()`` per rank into ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``
(legacy), as Megatron-LM's ``generate_state_dict`` and ``get_checkpoint_name`` lay them out. The other
way, workers load a checkpoint into ``GPTModel`` (``load_state_dict`` per rank, or
``dist_checkpointing.load`` with the model's ``sharded_state_dict``) and return its logits.

megatron-core runs on CPU here once, in these workers only, its CUDA-only calls are replaced:
the global memory buffer allocates on the CPU, the CUDA RNG tracker's ``fork`` is a null context
(dropout is 0), ``torch.cuda.synchronize``/``current_device`` do nothing / say ``"cpu"``,
``Tensor.cuda`` (the tied embedding's sync between pipeline stages) stays on the CPU; and the
causal mask is passed explicitly. ``dist_checkpointing.save`` leaves writer processes behind:
they are terminated before the worker returns.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import pathlib
import zlib

import torch
import torch.distributed as dist


def _patch_cuda_calls() -> None:
    import megatron.core.utils as mu
    from megatron.core.tensor_parallel import random as tr

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)

    mu.GlobalMemoryBuffer.get_tensor = get_tensor
    tr.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embedding's all-reduce between stages
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tu

    def sliding_window_mask(sq, skv, window_size):  # megatron-core's own, on the CPU
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
    fused_softmax.get_sliding_window_causal_mask = tu.get_sliding_window_causal_mask = sliding_window_mask


def padded(spec: dict) -> int:
    """Megatron's padded vocabulary at the spec's TP: a multiple of ``divisible * tp``."""
    m = spec["divisible"] * spec["tp"]
    return -(-spec["vocab"] // m) * m


def _llama_args(spec: dict) -> dict:
    """The Megatron-LM flags of ``spec["llama"]`` (a Llama-family run: ``--position-embedding-type rope
    --rotary-base B --rotary-percent P --normalization RMSNorm --norm-epsilon E --swiglu
    --group-query-attention --num-query-groups G --disable-bias-linear [--add-qkv-bias]`` and an untied
    output layer; ``spec["attn"]``: ``--kv-channels``, ``--qk-layernorm``, ``--window-size`` and
    ``--window-attn-skip-freq``), as ``pretrain_gpt.py`` saves them."""
    ll = spec.get("llama")
    if not ll:
        return {}
    return dict(position_embedding_type="rope", rotary_base=ll["rotary_base"], rotary_percent=ll["rotary_percent"],
                normalization="RMSNorm", norm_epsilon=ll["eps"], layernorm_epsilon=ll["eps"], swiglu=True,
                group_query_attention=True, num_query_groups=ll["groups"], add_bias_linear=False,
                add_qkv_bias=ll["qkv_bias"], rotary_interleaved=False, use_rope_scaling=False, openai_gelu=False,
                **spec.get("attn", {}))


def megatron_args(spec: dict) -> argparse.Namespace:
    """The saved args of a Megatron-LM run of this shape (the fields ``pretrain_gpt.py`` records
    that describe the model), with some of the objects real args hold (an enum, a path)."""
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(**{**dict(
        num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], kv_channels=spec["hidden"] // spec["heads"], num_query_groups=None,
        group_query_attention=False, seq_length=spec["seq"], max_position_embeddings=spec["seq"],
        position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False, add_bias_linear=True,
        layernorm_epsilon=1e-5, openai_gelu=spec["openai_gelu"],
        untie_embeddings_and_output_weights=spec["untie"], tokenizer_type="NullTokenizer", vocab_size=spec["vocab"] - 1,
        make_vocab_size_divisible_by=spec["divisible"], padded_vocab_size=padded(spec),
        tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"], num_experts=None,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, seed=1234, consumed_train_samples=56,
        iteration=7, attention_backend=AttnBackend.auto, data_cache_path=pathlib.PosixPath("/nowhere"),
        params_dtype=torch.float32, ckpt_format="torch_dist", data_parallel_size=spec.get("dp", 1),
        world_size=spec["tp"] * spec["pp"] * spec.get("dp", 1), overlap_grad_reduce=bool(spec.get("bucket")),
        ddp_bucket_size=spec.get("bucket"), ddp_num_buckets=None, ddp_pad_buckets_for_high_nccl_busbw=False,
        overlap_param_gather_with_optimizer_step=False, accumulate_allreduce_grads_in_fp32=False), **_llama_args(spec)})


def _config(spec: dict):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu
    kw = dict(activation_func=openai_gelu) if spec["openai_gelu"] else {}
    ll = spec.get("llama")
    if ll:  # Megatron-LM's TransformerConfig of the Llama flags (core_transformer_config_from_args)
        kw = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  bias_activation_fusion=False, num_query_groups=ll["groups"], add_bias_linear=False,
                  add_qkv_bias=ll["qkv_bias"])
        kw.update(spec.get("attn", {}))  # kv_channels, qk_layernorm, window_size, window_attn_skip_freq
    if spec.get("bf16"):
        kw.update(bf16=True, params_dtype=torch.bfloat16)
    return TransformerConfig(num_layers=spec["layers"], hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
                             num_attention_heads=spec["heads"], use_cpu_initialization=True, hidden_dropout=0.0,
                             attention_dropout=0.0, layernorm_epsilon=ll["eps"] if ll else 1e-5,
                             pipeline_dtype=torch.bfloat16 if spec.get("bf16") else torch.float32,
                             tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"], **kw)


def build_model(spec: dict, pre: bool = True, post: bool = True):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    torch.manual_seed(1234)
    ll = spec.get("llama")
    rope = dict(position_embedding_type="rope", rotary_base=ll["rotary_base"],
                rotary_percent=ll["rotary_percent"]) if ll else {}
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm" if ll else None,
                                          qk_layernorm=spec.get("attn", {}).get("qk_layernorm", False))
    return GPTModel(_config(spec), layer_spec, vocab_size=padded(spec), max_sequence_length=spec["seq"],
                    pre_process=pre, post_process=post, share_embeddings_and_output_weights=not spec["untie"], **rope)


@torch.no_grad()
def _perturb(model, tp_rank: int) -> None:
    """Non-trivial LayerNorms and biases (and an untied head unlike the embedding): deterministic
    noise, the same on every TP rank for replicated parameters."""
    for name, p in model.named_parameters():
        sharded = getattr(p, "tensor_model_parallel", False)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * tp_rank if sharded else 0))
        p.add_(0.1 * torch.randn(p.shape, generator=g))


def logits_of(model, spec: dict, tokens: torch.Tensor):
    """Megatron's forward, vocabulary shards all-gathered over TP, padding rows dropped. At PP > 1 the
    stages run one after the other, as megatron-core's schedules hand activations over: stage ``p > 0``
    receives the previous stage's output ``[s, b, h]`` (its own TP rank's; ``dist.recv``) and takes it
    through ``set_input_tensor``; every stage but the last sends its output on and returns ``None``."""
    from megatron.core import parallel_state as mp
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)  # True = masked
    p, pp = mp.get_pipeline_model_parallel_rank(), mp.get_pipeline_model_parallel_world_size()
    model.eval()
    with torch.no_grad():
        if p > 0:
            hidden = torch.empty(s, b, spec["hidden"])
            dist.recv(hidden, src=mp.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        local = model(tokens, positions, mask)
    if p < pp - 1:
        dist.send(local.contiguous(), dst=mp.get_pipeline_model_parallel_next_rank())
        return None
    group = mp.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :spec["vocab"]]


def _common(spec: dict) -> dict:
    return dict(args=megatron_args(spec), checkpoint_version=3.0, iteration=7)


def _leave() -> None:
    for child in multiprocessing.active_children():  # dist_checkpointing's writer processes
        child.terminate()
        child.join()


def save_both_formats(model, spec: dict, root: str) -> None:
    """Megatron's own writers: ``root/torch_dist`` and ``root/legacy`` checkpoint roots (and, where
    ``spec["singleton_shards"]``, ``root/torch_dist_singleton``: the ``torch_dist`` save with megatron-core's
    ``singleton_local_shards`` metadata, which keys SwiGLU's fc1 as ``<key>_w`` and ``<key>_v``)."""
    from megatron.core import dist_checkpointing, parallel_state
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = "mp_rank_%02d" % t if spec["pp"] == 1 else "mp_rank_%02d_%03d" % (t, p)
    legacy = os.path.join(root, "legacy", "iter_0000007", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(legacy), exist_ok=True)
    torch.save(dict(_common(spec), model=model.state_dict_for_save_checkpoint(),
                    rng_state=[dict(torch_rng_state=torch.get_rng_state())]), legacy)
    dist_dir = os.path.join(root, "torch_dist", "iter_0000007")
    if dist.get_rank() == 0:
        os.makedirs(dist_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(dict(_common(spec), model=model.sharded_state_dict()), dist_dir)
    fmts = ["legacy", "torch_dist"]
    if spec.get("singleton_shards"):  # SwiGLU's fc1 as two tensors, <key>_w (gates) and <key>_v (ups)
        fmts.append("torch_dist_singleton")
        single_dir = os.path.join(root, "torch_dist_singleton", "iter_0000007")
        if dist.get_rank() == 0:
            os.makedirs(single_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(dict(_common(spec), model=model.sharded_state_dict(
            metadata=dict(singleton_local_shards=True))), single_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        for fmt in fmts:
            with open(os.path.join(root, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
    _leave()


def _init(spec: dict) -> None:
    _patch_cuda_calls()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec["tp"],
                                             pipeline_model_parallel_size=spec["pp"])


def _stage(spec: dict):
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()


def save_reference(ps, spec: dict, root: str, tokens: torch.Tensor):
    """Worker (world = TP, PP 1): build, perturb, run, save both formats and each rank's state dict
    (for the pipeline-parallel saves); returns Megatron's logits."""
    _init(dict(spec, pp=1))
    model = build_model(dict(spec, pp=1))
    _perturb(model, _stage(dict(spec, pp=1))[1])
    logits = logits_of(model, spec, tokens)
    save_both_formats(model, dict(spec, pp=1), root)
    torch.save(model.state_dict(), os.path.join(root, f"state_tp{_stage(spec)[1]}.pt"))
    return logits


def save_pipeline(ps, spec: dict, root: str, flat_root: str, tokens: torch.Tensor):
    """Worker (world = TP x PP): each stage's ``GPTModel`` takes its layers from the TP rank's PP-1
    state dict (renumbered within the stage, as Megatron numbers them) and is saved in both formats;
    returns its state dict and the pipeline's logits (:func:`logits_of`; ``None`` off the last stage)."""
    _init(spec)
    p, t = _stage(spec)
    pp, per = spec["pp"], spec["layers"] // spec["pp"]
    model = build_model(spec, pre=p == 0, post=p == pp - 1)
    flat = torch.load(os.path.join(flat_root, f"state_tp{t}.pt"), weights_only=True)
    want = model.state_dict()
    for key in want:
        src = key
        if key.startswith("decoder.layers."):
            j, rest = key[len("decoder.layers."):].split(".", 1)
            src = f"decoder.layers.{p * per + int(j)}.{rest}"
        elif key == "output_layer.weight" and not spec["untie"]:
            src = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
        want[key] = flat[src]
    model.load_state_dict(want, strict=True)
    save_both_formats(model, spec, root)
    return dict(state={k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
                logits=logits_of(model, spec, tokens))


def load_and_run(ps, spec: dict, root: str, fmt: str, tokens: torch.Tensor):
    """Worker (world = TP x PP): load a checkpoint root written by tnlg into ``GPTModel`` with
    Megatron's loaders; returns the logits (at PP > 1: the last stage's, :func:`logits_of`) and at PP > 1
    every stage's state dict."""
    _init(spec)
    from megatron.core import dist_checkpointing
    p, t = _stage(spec)
    pp = spec["pp"]
    model = build_model(spec, pre=p == 0, post=p == pp - 1)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        it_dir = os.path.join(root, "iter_%07d" % int(f.read()))
    if fmt == "legacy":
        name = "mp_rank_%02d" % t if pp == 1 else "mp_rank_%02d_%03d" % (t, p)
        state = torch.load(os.path.join(it_dir, name, "model_optim_rng.pt"), weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        common = state
    else:
        loaded = dist_checkpointing.load(dict(model=model.sharded_state_dict()), it_dir)
        model.load_state_dict(loaded["model"], strict=True)
        common = dist_checkpointing.load_common_state_dict(it_dir)
    _leave()
    args = vars(common["args"])
    out = dict(args={k: args[k] for k in ("padded_vocab_size", "num_layers", "tensor_model_parallel_size",
                                          "openai_gelu", "untie_embeddings_and_output_weights")},
               iteration=common["iteration"])
    out["logits"] = logits_of(model, spec, tokens)  # at PP > 1: the last stage's
    if pp > 1:
        out["state"] = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        out["stage"], out["tp_rank"] = p, t
    return out


# --------------------------------------------------------------------------- the optimizer

def _patch_optimizer_calls() -> None:
    """megatron-core's optimizers on the CPU: tensors it makes on ``device="cuda"`` (found-inf flags,
    the unit loss scale) are made on the CPU, and ``Tensor.type()`` names CPU tensors as the CUDA
    types its precision checks accept (``torch.cuda.FloatTensor``)."""
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        def on_cpu(*a, _make=getattr(torch, name), **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return _make(*a, **k)
        setattr(torch, name, on_cpu)
    named = torch.Tensor.type

    def type_(self, *a, **k):
        t = named(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not (a or k) and not t.startswith("torch.cuda.") else t
    torch.Tensor.type = type_


ADAM = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup=1, decay=10, batch=2)


def _trained(spec: dict, distributed: bool, tokens: torch.Tensor, pre: bool = True, post: bool = True):
    """GPTModel (perturbed as :func:`save_reference`) in megatron-core's DDP with its Adam
    (``get_megatron_optimizer``: the non-distributed or the distributed optimizer) and its LR
    scheduler (``OptimizerParamScheduler``, stepped by the global batch as Megatron-LM's loop does)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module
    model = build_model(spec, pre, post)
    _perturb(model, parallel_state.get_tensor_model_parallel_rank())
    bf16 = bool(spec.get("bf16"))
    # spec["bucket"]: Megatron-LM's --overlap-grad-reduce --ddp-bucket-size N (several gradient buckets)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                               overlap_grad_reduce=bool(spec.get("bucket")),
                                               bucket_size=spec.get("bucket"))
    ddp = DistributedDataParallel(model.config, ddp_config, Float16Module(model.config, model) if bf16 else model)
    a = ADAM
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a["lr"], min_lr=a["min_lr"], weight_decay=a["weight_decay"], adam_beta1=a["betas"][0],
        adam_beta2=a["betas"][1], adam_eps=a["eps"], clip_grad=0.0, use_distributed_optimizer=distributed, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=a["lr"], min_lr=a["min_lr"],
                                    lr_warmup_steps=a["warmup"] * a["batch"], lr_decay_steps=a["decay"] * a["batch"],
                                    lr_decay_style="cosine", start_wd=a["weight_decay"], end_wd=a["weight_decay"],
                                    wd_incr_steps=a["decay"] * a["batch"], wd_incr_style="constant")
    return model, ddp, opt, sched


def _adam_step(model, ddp, opt, sched, tokens: torch.Tensor) -> float:
    """One Megatron training step on the mean cross-entropy of ``tokens`` (labels = tokens); returns its lr."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    model.train()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens, positions, mask, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    lr = opt.param_groups[0]["lr"]
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=ADAM["batch"])
    return lr


def _moments(model, opt, distributed: bool) -> dict:
    """Megatron's live Adam state per parameter name (this rank's TP shard, in the parameter's shape):
    the moments, and the fp32 master of a 16-bit model. The distributed optimizer holds a DP rank's
    range of each parameter (``_get_model_param_range_map``): the ranges are summed over the DP group
    into zeros (exact: each element comes from one rank)."""
    from megatron.core import parallel_state
    inner = opt.chained_optimizers[0]
    sixteen = next(model.parameters()).dtype != torch.float32
    masters = {} if distributed or not sixteen else {  # Float16OptimizerWithFloat16Params' fp32 copies
        p: m for g16, g32 in zip(inner.float16_groups, inner.fp32_from_float16_groups) for p, m in zip(g16, g32)}
    kinds = ("exp_avg", "exp_avg_sq") + (("param",) if sixteen else ())
    out = {}
    for name, p in model.named_parameters():
        if not distributed:
            st = dict(inner.optimizer.state[masters.get(p, p)], param=masters.get(p))
            out[name] = {k: st[k].detach().clone().reshape(p.shape) for k in kinds}
            continue
        full = {k: torch.zeros(p.numel()) for k in kinds}
        if p in inner.model_param_gbuf_map:  # this DP rank owns a range of p
            st, rng = inner._get_main_param_and_optimizer_states(p), inner._get_model_param_range_map(p)["param"]
            for k in kinds:
                full[k][rng.start:rng.end] = st[k].detach().float()
        for k in kinds:
            dist.all_reduce(full[k], group=parallel_state.get_data_parallel_group())
        out[name] = {k: v.reshape(p.shape) for k, v in full.items()}
    return out


def bucket_facts(ddp) -> dict:
    """What megatron-core's own gradient buffer did (``_ParamAndGradBuffer``): the buckets' padded and
    unpadded sizes, the gaps its 64-element alignment left between parameters, and the parameters
    whose range crosses a DP rank's shard of their bucket."""
    buf, dp = ddp.buffers[0], dist.get_world_size(ddp.buffers[0].data_parallel_group)
    spans = sorted(buf.param_index_map.values())
    gaps = sum(b[0] > a[1] and a[2] == b[2] for a, b in zip(spans, spans[1:]))
    straddling = 0
    for start, end, bucket in spans:
        lo, hi = buf.buckets[bucket].offset, buf.buckets[bucket].offset + buf.buckets[bucket].grad_data.numel()
        cut = lo + (hi - lo) // dp * torch.arange(1, dp)
        straddling += int(((cut > start) & (cut < end)).any())
    return dict(buckets=[(b.grad_data.numel(), b.numel_unpadded) for b in buf.buckets], gaps=gaps,
                straddling=straddling)


def _save_legacy(model, opt, sched, spec: dict, steps: int, distributed: bool, root: str) -> None:
    """The legacy per-rank files (``--ckpt-format torch``) as Megatron-LM's ``save_checkpoint`` writes
    them: ``model_optim_rng.pt`` with ``optimizer.state_dict()`` (the distributed optimizer's holds
    only its param groups; its states go to ``distrib_optim.pt`` by ``save_parameter_state``)."""
    from megatron.core import parallel_state
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    d = os.path.join(root, "iter_%07d" % steps, "mp_rank_%02d" % t if spec["pp"] == 1 else "mp_rank_%02d_%03d" % (t, p))
    os.makedirs(d, exist_ok=True)
    dist.barrier()
    args = megatron_args(spec)
    args.iteration, args.global_batch_size, args.use_distributed_optimizer = steps, ADAM["batch"], distributed
    args.bf16, args.params_dtype, args.ckpt_format = bool(spec.get("bf16")), next(model.parameters()).dtype, "torch"
    state = dict(args=args, checkpoint_version=3.0, iteration=steps, model=model.state_dict_for_save_checkpoint(),
                 optimizer=opt.state_dict(), opt_param_scheduler=sched.state_dict())
    if parallel_state.get_data_parallel_rank() == 0:  # one file per model-parallel rank
        torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    if distributed:  # gathers over DP, saved by DP rank 0
        opt.chained_optimizers[0].save_parameter_state(os.path.join(d, "distrib_optim.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(steps))


def _save_torch_dist(model, opt, sched, spec: dict, steps: int, distributed: bool, layout, root: str) -> None:
    """``dist_checkpointing.save`` of the model and optimizer's sharded state dicts (the distributed
    optimizer's in ``layout``) and the scheduler's state, as Megatron-LM's ``generate_state_dict``."""
    from megatron.core import dist_checkpointing
    meta = dict(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    if layout:
        meta["distrib_optim_sharding_type"] = layout
    msd = model.sharded_state_dict(metadata=meta)
    args = megatron_args(spec)
    args.iteration, args.global_batch_size, args.use_distributed_optimizer = steps, ADAM["batch"], distributed
    args.bf16, args.params_dtype = bool(spec.get("bf16")), next(model.parameters()).dtype
    state = dict(args=args, checkpoint_version=3.0, iteration=steps, model=msd,
                 optimizer=opt.sharded_state_dict(msd, metadata=meta), opt_param_scheduler=sched.state_dict())
    d = os.path.join(root, "iter_%07d" % steps)
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, d)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(steps))


def save_distributed_pipeline(ps, spec: dict, root: str):
    """Worker (world = TP x PP): each stage's GPTModel in megatron-core's DDP with the distributed
    optimizer. megatron-core's schedules do not run on CPU here, so there is no training step: the
    optimizer's states are allocated (``_init_optimizer_states_with_dummy_values``: Adam's step 1 on zero
    gradients) and its moments set to deterministic noise. Saved as ``dp_reshardable`` (``root/
    dp_reshardable``) and in the legacy files (``root/legacy_distributed``); returns the stage, the TP
    rank and the moments read back from the optimizer object (:func:`_moments`)."""
    _init(spec)
    _patch_optimizer_calls()
    p, t = _stage(spec)
    model, ddp, opt, sched = _trained(spec, True, None, pre=p == 0, post=p == spec["pp"] - 1)
    inner = opt.chained_optimizers[0]
    inner._init_optimizer_states_with_dummy_values()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param in inner.model_param_gbuf_map:
                st = inner._get_main_param_and_optimizer_states(param)
                g = torch.Generator().manual_seed(zlib.crc32(f"{name} {p} {t} {dist.get_rank()}".encode()))
                st["exp_avg"].copy_(torch.randn(st["exp_avg"].shape, generator=g))
                st["exp_avg_sq"].copy_(torch.rand(st["exp_avg_sq"].shape, generator=g))
    _save_torch_dist(model, opt, sched, spec, 1, True, "dp_reshardable", os.path.join(root, "dp_reshardable"))
    _save_legacy(model, opt, sched, spec, 1, True, os.path.join(root, "legacy_distributed"))
    out = dict(stage=p, tp_rank=t, distributed=dict(moments=_moments(model, opt, True)))
    _leave()
    return out


def train_and_save(ps, spec: dict, root: str, tokens: torch.Tensor, steps: int):
    """Worker (world = TP x DP, PP 1): the non-distributed and the distributed optimizer (two identical
    models; ``spec["optimizers"]``: only those named) each take ``steps`` Adam steps on ``tokens`` and are
    saved by ``dist_checkpointing.save`` with their optimizer's ``sharded_state_dict`` and the scheduler's
    state, as Megatron-LM's ``generate_state_dict`` (:func:`_save_torch_dist`: ``root/<plain|distributed>``;
    the distributed one in the model-space
    ``fully_reshardable`` layout, and in the bucket layout ``dp_reshardable`` under
    ``root/dp_reshardable``), and in the legacy per-rank files (``root/legacy_<plain|distributed>``:
    :func:`_save_legacy`). Then each takes one more step: returns per optimizer the moments after
    ``steps``, the lr of the next step, the parameters after it and (distributed) :func:`bucket_facts`.
    Every DP rank steps on the same ``tokens``."""
    _init(dict(spec, pp=1))
    _patch_optimizer_calls()
    out = {}
    for kind in spec.get("optimizers", ("plain", "distributed")):
        distributed = kind == "distributed"
        model, ddp, opt, sched = _trained(dict(spec, pp=1), distributed, tokens)
        for _ in range(steps):
            _adam_step(model, ddp, opt, sched, tokens)
        layouts = {kind: "fully_reshardable", "dp_reshardable": "dp_reshardable"} if distributed else {kind: None}
        for name, layout in layouts.items():
            _save_torch_dist(model, opt, sched, dict(spec, pp=1), steps, distributed, layout, os.path.join(root, name))
        _save_legacy(model, opt, sched, dict(spec, pp=1), steps, distributed, os.path.join(root, f"legacy_{kind}"))
        moments = _moments(model, opt, distributed)
        lr = _adam_step(model, ddp, opt, sched, tokens)
        out[kind] = dict(moments=moments, lr=lr, params={n: p.detach().clone() for n, p in model.named_parameters()},
                         buckets=bucket_facts(ddp) if distributed else None)
    _leave()
    return out


# --------------------------------------------------------------------------- autocast on the CPU

def patch_cpu_autocast() -> None:
    """megatron-core's linear layers under ``torch.autocast("cpu")``: their autograd functions are
    decorated with ``custom_fwd/custom_bwd(device_type="cuda")``, so on the CPU backward runs without
    the forward's autocast state and meets a bf16 gradient beside an fp32 weight. Each such forward
    and backward is decorated again, undecorated first (``__wrapped__``), for ``"cpu"``."""
    from megatron.core.tensor_parallel import layers
    for fn in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        fwd, bwd = fn.forward, fn.backward
        fn.forward = staticmethod(torch.amp.custom_fwd(getattr(fwd, "__wrapped__", fwd), device_type="cpu"))
        fn.backward = staticmethod(torch.amp.custom_bwd(getattr(bwd, "__wrapped__", bwd), device_type="cpu"))
