#!/usr/bin/env python
"""A LoRA fine-tuning step against a full fine-tuning step of the same model and tokens: time and peak memory.

Both run tnlg's training step (:func:`tnlg.training.step.train_step`: forward, the loss, backward, clipping and
AdamW in the ZeRO engine at DP 1, fp32) on the same Llama-shaped model (rope, RMSNorm, SwiGLU, grouped-query
attention) and the same batch; the LoRA model has rank-R adapters on every linear layer (PEFT's
``all-linear``: q, k, v, o, gate, up, down) and a frozen base, so the engine holds the adapters alone. Peak
memory is what :class:`tnlg.plan.tracker.StepTracker` sees live during one step (the parameters, the
engine's gradient and Adam buffers, and every activation and temporary of the step); time is the median of
``--rounds`` steps, the two kinds alternating. JSON: every step's time, the peaks by kind, the CPU, the date.

    python scripts/bench_lora.py             # ~1 min on 2 CPU cores
    python scripts/bench_lora.py --tiny      # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics

import _bench


def _model(args, lora: bool):
    import torch

    from tnlg import GPTConfig, init_parallel
    from tnlg.adapters import LoraSettings
    from tnlg.interop.peft import add_lora
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    ps = init_parallel()
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    group_query_attention=True, num_query_groups=max(1, args.heads // 4), seq_length=args.seq,
                    vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                    swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                    untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    model = GPT(cfg, ps)
    if lora:
        add_lora(model, LoraSettings(args.rank, 2.0 * args.rank), ["all-linear"])
    return build_engine(model, ps, 0, lr=1e-4), ps


def _step(engine, ps, batch, iteration: int):
    from tnlg.training.step import train_step
    train_step(engine.model, engine, [batch], 1e-4, autocast=None, ps=ps, iteration=iteration, per_token_loss=True)


def _peak(engine, ps, batch) -> dict:
    """Bytes live at the step's peak, by kind (one tracked step after a warm-up one)."""
    from tnlg.plan.tracker import StepTracker
    _step(engine, ps, batch, 1)
    backend = engine.backend
    tracker = StepTracker()
    with tracker:
        tracker.register(list(engine.model.parameters()), "parameters")
        tracker.register(backend.grad_buffer, "gradients")
        tracker.register([backend.exp_avg, backend.exp_avg_sq], "adam")
        with tracker.phase("forward, backward and AdamW") as ph:
            _step(engine, ps, batch, 2)
    return dict(peak_bytes=ph.peak, by_kind=ph.peak_by_kind, live_start=ph.live_start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _bench.add_shape_arguments(p, layers=4, hidden=512, heads=8, seq=256)
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a smoke test: 2 layers, 64 wide, 64 positions, 2 rounds")
    p.add_argument("--json", default=os.path.join(_bench.ROOT, "docs", "bench_lora.json"))
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.rounds, args.vocab, args.rank = 2, 64, 4, 64, 2, 512, 4
    import torch
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g)
    batch = dict(tokens=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=torch.ones(tokens.shape))
    engines = {"full fine-tuning": _model(args, False), f"LoRA r={args.rank}": _model(args, True)}
    peaks = {name: _peak(e, ps, batch) for name, (e, ps) in engines.items()}
    times = _bench.alternating_times({name: (lambda r, e=e, ps=ps: _step(e, ps, batch, r + 3))
                                      for name, (e, ps) in engines.items()}, args.rounds, args.warmup)
    trainable = {name: sum(p.numel() for p in e.model.parameters() if p.requires_grad) for name, (e, _) in engines.items()}
    print(f"{'step':<20}{'trainable':>12}{'median ms':>11}{'peak MiB':>10}{'  model states MiB (params/grads/adam)'}")
    for name in engines:
        k = peaks[name]["live_start"]
        states = "/".join(f"{k.get(x, 0) / 2**20:.1f}" for x in ("parameters", "gradients", "adam"))
        print(f"{name:<20}{trainable[name]:>12,}{statistics.median(times[name]) * 1e3:>11.1f}"
              f"{peaks[name]['peak_bytes'] / 2**20:>10.1f}  {states}")
    full, lora = (peaks[n]["peak_bytes"] for n in engines)
    t_full, t_lora = (statistics.median(times[n]) for n in engines)
    print(f"LoRA / full: peak memory {lora / full:.3f} (target <= 0.4), step time {t_lora / t_full:.3f}, on "
          f"{_bench.cpu_name()}")
    _bench.write_json(args.json, dict(machine=_bench.machine_info(), args=vars(args), times=times, peaks=peaks,
                                      trainable=trainable, memory_ratio=lora / full, time_ratio=t_lora / t_full))
    return 0


if __name__ == "__main__":
    _bench.run(main)
