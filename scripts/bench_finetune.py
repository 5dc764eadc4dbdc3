#!/usr/bin/env python
"""A packed fine-tuning step against a pretraining step of the same shape and tokens.

Both steps run tnlg's training step (:func:`tnlg.training.step.train_step`: forward, the per-token loss,
backward, clipping and AdamW in the ZeRO engine at DP 1) on the same model, one process. The fine-tuning
batch is what ``tnlg finetune`` trains on: prompt/completion rows (prompts and completions of varied length,
drawn from the built-in corpus's text) tokenized, packed into sequences (:mod:`tnlg.data.sft`) with their
block-causal masks, restarting positions and completion-only loss masks. The pretraining batch holds the same
tokens as one causal sequence each (no mask: the causal kernel). The two alternate within each round; the
table gives the median and fastest step of each and the ratio of the medians (target: at most 1.05), and the
tokens per second (all positions, and the counted ones). JSON: every step's time, the CPU, the date.

    python scripts/bench_finetune.py                  # ~1 min on 2 CPU cores
    python scripts/bench_finetune.py --tiny           # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile

import _bench


def _rows(n: int, seed: int) -> list[dict]:
    """Prompt/completion rows cut from the built-in corpus's text: prompts of 20-200 characters, completions of
    10-400."""
    from tnlg.data.corpus import corpus_documents
    text = "\n".join(body for _, body in corpus_documents())
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randrange(0, len(text) - 1000)
        p, c = rng.randrange(20, 200), rng.randrange(10, 400)
        rows.append(dict(prompt=text[start:start + p], completion=text[start + p:start + p + c]))
    return rows


def _batches(args, tok, folder: str):
    """(fine-tuning batch, pretraining batch): the first ``--micro-batch`` packed sequences, and their tokens
    as plain causal sequences."""
    import torch

    from tnlg.data.sft import build_sft_datasets
    rows = os.path.join(folder, "rows.jsonl")
    with open(rows, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows(args.rows, 0))
    ds, _, report = build_sft_datasets(rows, None, tok, args.seq, train_samples=args.micro_batch, valid_samples=0,
                                       seed=0, packing=True)
    items = [ds[i] for i in range(args.micro_batch)]
    sft = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    plain = dict(tokens=sft["tokens"], labels=sft["labels"], loss_mask=torch.ones_like(sft["loss_mask"]))
    return sft, plain, report


def _step_times(args, batches: dict) -> dict:
    import torch

    from tnlg import GPTConfig, init_parallel
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.training.step import train_step
    torch.set_num_threads(args.threads)
    ps = init_parallel()
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    engine = build_engine(GPT(cfg, ps), ps, 1)

    def step(batch):
        return lambda r: train_step(engine.model, engine, [batch], 1e-5, autocast=None, ps=ps, iteration=r + 1,
                                    per_token_loss=True)
    return _bench.alternating_times({name: step(batch) for name, batch in batches.items()}, args.rounds, args.warmup)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _bench.add_shape_arguments(p, layers=4, hidden=256, heads=4, seq=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rows", type=int, default=400, help="fine-tuning rows to pack (default 400)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a smoke test: 2 layers, 64 wide, 128 positions, 3 rounds")
    p.add_argument("--json", default=os.path.join(_bench.ROOT, "docs", "bench_finetune.json"))
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.seq, args.rounds, args.warmup, args.rows = 2, 64, 128, 3, 1, 60
    from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
    tok = load_tokenizer(builtin_tokenizer_path())
    args.vocab = tok.vocab_size
    with tempfile.TemporaryDirectory() as folder:
        sft, plain, report = _batches(args, tok, folder)
    times = _step_times(args, {"packed fine-tuning": sft, "pretraining": plain})
    counted = int(sft["loss_mask"].sum())
    positions = sft["tokens"].numel()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{report.line()}\n{'step':<20}{'median ms':>11}{'fastest ms':>12}{'tok/s':>10}{'counted tok/s':>15}")
    for name, ts in times.items():
        print(f"{name:<20}{med[name] * 1e3:>11.1f}{min(ts) * 1e3:>12.1f}{positions / med[name]:>10.0f}"
              f"{(counted if name != 'pretraining' else positions) / med[name]:>15.0f}")
    ratio = med["packed fine-tuning"] / med["pretraining"]
    print(f"packed fine-tuning / pretraining (medians): {ratio:.3f} (target <= 1.05) on {_bench.cpu_name()}")
    _bench.write_json(args.json, dict(machine=_bench.machine_info(), args=vars(args), times=times, ratio=ratio,
                                      positions=positions, counted_tokens=counted, packing=report.line()))
    return 0


if __name__ == "__main__":
    _bench.run(main)
