"""A mixture-of-experts training step at EP 1 and EP 2 beside a dense model of the same active parameters, and
tnlg's MoE layer beside megatron-core's, on 2 gloo processes (DP 2, one thread each): tokens/s per rank and the
share of the step spent in the token collectives (timed where they run). Prints a table and writes JSON
(docs/moe.md).

    python scripts/bench_moe.py [--layers 2 --hidden 256 --experts 8 --topk 2 --expert-ffn 512 --seq 256] [--tiny]

**Model rows** (``model ...``): a whole training step of tnlg's GPT (Llama-style: rope, RMSNorm, SwiGLU), AdamW
through tnlg's engine (ZeRO 1; at EP 2 one flat backend per gradient kind). The dense model's MLP is ``top-k x
expert width`` wide (SwiGLU), so a token runs through as many MLP parameters as in the MoE (the router's ``E h``
aside).

**Layer rows** (``layer ...``): one MoE layer alone, forward and backward, in the same two processes on the same
inputs (per rank and step the same random ``[s, b, h]`` hidden states and output gradient, seeded by the rank):
tnlg's :class:`~tnlg.model.moe.MoELayer` and megatron-core 0.16.1's ``MoELayer`` built from the same shapes (E,
top-k, expert width, SwiGLU experts without biases, softmax top-k router, the ``aux_loss`` load-balancing loss of
coefficient 0.01 in its backward). No gradient reduction and no optimizer step in either. They differ in how the
tokens travel and how the experts run: tnlg dispatches with all-to-all (each rank sends only the copies routed to
the other rank's experts) and runs its experts as one grouped matmul (``torch._grouped_mm``); megatron-core's
layer runs on CPU only with its ``allgather`` dispatcher (every rank gathers every rank's tokens, routing map and
probabilities, and the outputs come back by reduce-scatter) and its ``SequentialMLP`` (a loop over the local
experts; its grouped GEMM needs CUDA), with :mod:`tests.megatron_moe_reference`'s patches of its CUDA-only calls.
The collective share: tnlg's all-to-all, megatron-core's gathers and reduce-scatter (forward and backward).
megatron-core's rows are skipped, with the reason printed, when it is not installed or ``--without-megatron``.

The rows are timed in groups, their steps alternating (all the model rows; each EP's layer rows): a busy
moment of a shared machine then slows every row of a group alike. The median of the timed steps after the
warm-up ones; the slower rank's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import _bench  # noqa: F401  (the repository on sys.path)
from _bench import add_shape_arguments, machine_info, run, write_json

from tnlg.runtime.spawn import run_distributed

# (row name, what runs, EP, framework)
MODEL_ROWS = (("model dense (same active MLP)", "model", 1, "dense"), ("model MoE EP 1", "model", 1, "tnlg"),
              ("model MoE EP 2", "model", 2, "tnlg"))
LAYER_ROWS = (("layer tnlg EP 1", "layer", 1, "tnlg"), ("layer tnlg EP 2", "layer", 2, "tnlg"))
MEGATRON_ROWS = (("layer megatron-core EP 1", "layer", 1, "megatron"),
                 ("layer megatron-core EP 2", "layer", 2, "megatron"))
TINY = dict(layers=1, hidden=64, heads=2, seq=32, experts=4, topk=2, expert_ffn=64, batch=2, warmup=1, iters=2)


def megatron_available() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


class _Clock:
    """Seconds spent in the timed collectives since the last :meth:`reset`."""

    def __init__(self):
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            self.seconds += time.perf_counter() - t
            return out
        return timed


def _time_tnlg_all_to_all(clock: _Clock) -> None:
    """tnlg's all-to-all, forward (the function) and backward (its autograd function), counted on ``clock``."""
    import tnlg.parallel.experts as comm
    comm.all_to_all = clock.wrap(comm.all_to_all)
    comm._AllToAll.backward = staticmethod(clock.wrap(comm._AllToAll.backward))


def _time_megatron_collectives(clock: _Clock) -> None:
    """megatron-core's sequence-parallel gather and reduce-scatter (its ``allgather`` dispatcher's collectives over
    TP x EP), forward and backward, counted on ``clock``."""
    from megatron.core.tensor_parallel import mappings as mm
    for cls in (mm._GatherFromSequenceParallelRegion, mm._ReduceScatterToSequenceParallelRegion):
        cls.forward = staticmethod(clock.wrap(cls.forward))
        cls.backward = staticmethod(clock.wrap(cls.backward))


def _moe_config(shape: dict, ep_ps=None):
    from tnlg.config import LLAMA, GPTConfig
    return GPTConfig(num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                     seq_length=shape["seq"], vocab_size=1024, **LLAMA, num_experts=shape["experts"],
                     moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["expert_ffn"], moe_aux_loss_coeff=0.01)


def _model_step(ps, shape: dict, ep: int, framework: str, batch: int):
    """A whole tnlg training step (module docstring): ``(step(i), parameters on this rank, active parameters)``."""
    import torch

    from tnlg.config import LLAMA, GPTConfig
    from tnlg.model import GPT
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.state import init_expert_parallel
    ps = init_expert_parallel(ps, ep)
    s = shape["seq"]
    if framework == "dense":
        cfg = GPTConfig(num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                        seq_length=s, vocab_size=1024, **LLAMA, ffn_hidden_size=shape["topk"] * shape["expert_ffn"])
    else:
        cfg = _moe_config(shape)
    engine = build_engine(GPT(cfg, ps), ps.for_gradients(), zero_stage=1, lr=1e-4)
    g = torch.Generator().manual_seed(ps.dp_rank)

    def step(i: int) -> None:
        tok = torch.randint(0, 1024, (batch, s + 1), generator=g)
        engine.zero_grad()
        loss = engine.model(tok[:, :-1], labels=tok[:, 1:])
        engine.backward(loss)
        engine.step()
    return step, sum(p.numel() for p in engine.model.parameters()), cfg.active_parameters(), lambda: None


def _tnlg_layer(ps, shape: dict, ep: int):
    from tnlg.model.forward import ForwardContext
    from tnlg.model.moe import MoELayer
    from tnlg.parallel.state import init_expert_parallel
    layer = MoELayer(_moe_config(shape), init_expert_parallel(ps, ep), 0)
    layer.train()

    def forward(x):
        ctx = ForwardContext()
        out = layer(x, ctx)
        return out, sum(ctx.aux.values())
    return layer, forward, lambda: None


def _megatron_layer(ps, shape: dict, ep: int):
    """megatron-core's ``MoELayer`` of the same shapes (module docstring), its parallel state at EP ``ep``."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    config = TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], ffn_hidden_size=shape["topk"] * shape["expert_ffn"],
        num_attention_heads=shape["heads"], use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        add_bias_linear=False, pipeline_dtype=torch.float32, num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["expert_ffn"], moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    layer = build_module(get_moe_module_spec(use_te=False, num_experts=shape["experts"], moe_grouped_gemm=False),
                         config=config, layer_number=1)
    layer.train()

    def forward(x):  # (the aux loss's gradient joins in the layer's backward: megatron-core's MoEAuxLossAutoScaler)
        out, _ = layer(x)
        return out, None
    return layer, forward, parallel_state.destroy_model_parallel


def _layer_step(ps, shape: dict, ep: int, framework: str, batch: int):
    """One MoE layer's forward and backward (module docstring): ``(step(i), parameters on this rank, None,
    cleanup)``."""
    import torch
    layer, forward, cleanup = (_tnlg_layer if framework == "tnlg" else _megatron_layer)(ps, shape, ep)
    g = torch.Generator().manual_seed(1000 + ps.dp_rank)
    shape_x = (shape["seq"], batch, shape["hidden"])

    def step(i: int) -> None:
        x = torch.randn(shape_x, generator=g).requires_grad_()
        grad = torch.randn(shape_x, generator=g)
        layer.zero_grad(set_to_none=True)
        out, aux = forward(x)
        loss = (out * grad).sum()
        (loss if aux is None else loss + aux).backward()
    return step, sum(p.numel() for p in layer.parameters()), None, cleanup


def _groups(rows: list) -> list[list]:
    """The rows timed together, their steps alternating (so that a busy moment of the shared machine hits each
    alike): the model rows, then each EP's layer rows (megatron-core holds one EP at a time, in its globals)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(("model",) if row[1] == "model" else ("layer", row[2]), []).append(row)
    return list(groups.values())


def _worker(ps, shape: dict, rows: list, warmup: int, iters: int, batch: int):
    """Every row in these two processes, group by group (:func:`_groups`); megatron-core's patches (process-wide)
    made before its first layer, after every tnlg model row."""
    import warnings

    import torch.distributed as dist
    warnings.filterwarnings("ignore")  # megatron-core's import-time notes (no Apex, no Transformer Engine)
    clock = _Clock()
    _time_tnlg_all_to_all(clock)
    patched = False
    results = {}
    for group in _groups(rows):
        steps = {}
        for name, what, ep, framework in group:
            if framework == "megatron" and not patched:
                from tests import megatron_moe_reference
                megatron_moe_reference._patch()
                _time_megatron_collectives(clock)
                patched = True
            build = _model_step if what == "model" else _layer_step
            steps[name] = build(ps, shape, ep, framework, batch)
        times: dict = {name: [] for name in steps}
        shares: dict = {name: [] for name in steps}
        dist.barrier()
        for i in range(warmup + iters):
            for name, (step, *_) in steps.items():
                clock.reset()
                t = time.perf_counter()
                step(i)
                dt = time.perf_counter() - t
                if i >= warmup:
                    times[name].append(dt)
                    shares[name].append(clock.seconds / dt)
        for name, (_, params, active, cleanup) in steps.items():
            cleanup()
            med = statistics.median(times[name])
            results[name] = dict(step_s=med, tokens_per_s=batch * shape["seq"] / med,
                                 collective_share=statistics.median(shares[name]), params=params, active=active,
                                 times=times[name])
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, layers=2, hidden=256, heads=4, seq=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a smoke test's shape: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in TINY.items()))
    p.add_argument("--without-megatron", action="store_true", help="leave megatron-core's layer rows out")
    p.add_argument("--out", default="runs/bench_moe.json")
    a = p.parse_args()
    if a.tiny:
        for k, v in TINY.items():
            setattr(a, k, v)
    shape = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, experts=a.experts, topk=a.topk,
                 expert_ffn=a.expert_ffn)
    rows = list(MODEL_ROWS + LAYER_ROWS)
    skipped = None
    if a.without_megatron:
        skipped = "--without-megatron"
    elif not megatron_available():
        skipped = "megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)"
    else:
        rows += MEGATRON_ROWS
    if skipped:
        print(f"note: megatron-core's MoE layer rows skipped: {skipped}")
    per_rank = run_distributed(_worker, 2, 1, shape, rows, a.warmup, a.iters, a.batch, timeout_s=1800)
    table = {}
    for name, *_ in rows:
        r = [rank[name] for rank in per_rank]
        table[name] = dict(step_s=max(x["step_s"] for x in r), tokens_per_s=min(x["tokens_per_s"] for x in r),
                           collective_share=max(x["collective_share"] for x in r), params_rank0=r[0]["params"],
                           active=r[0]["active"], times=[x["times"] for x in r])
    print(f"{shape}, {a.batch} sequences per rank; {_bench.cpu_name()}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'run':30s} {'step ms':>9s} {'tok/s/rank':>11s} {'collectives':>11s} {'params/rank':>12s} {'active':>10s}")
    for name, r in table.items():
        active = f"{r['active']:10,d}" if r["active"] is not None else f"{'':>10s}"
        print(f"{name:30s} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:11.0f} {r['collective_share']:10.1%} "
              f"{r['params_rank0']:12,d} {active}")
    write_json(a.out, dict(machine=machine_info(args=vars(a), load_average=os.getloadavg(),
                                                megatron_core=_bench.package_version("megatron-core")),
                           rows=table, megatron_skipped=skipped))
    return 0


if __name__ == "__main__":
    run(main)
