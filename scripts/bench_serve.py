"""Serving benchmark: tokens/s and time to first token of ``tnlg serve`` for 1, 4 and 16 concurrent streams.

A random-weight GPT-2-shaped model (the built-in SentencePiece vocabulary, 4096 ids; the shape set with flags)
is written as a Hugging Face folder and served by ``tnlg serve`` (a real process, ``--port 0``,
``--max-batch`` = the most concurrent streams) at each ``--tp``. For each concurrency ``c`` (``--streams``),
``c`` clients at once each stream one completion of ``--new-tokens`` tokens (greedy; a stream that reaches the
end-of-document id ends early, and the tokens counted are those the server sent) after a ``--prompt-len``
token prompt, over server-sent events. Every step runs all ``--max-batch`` rows, so one stream alone pays
for the idle rows too. Reported per concurrency: aggregate new tokens per second (all
streams' tokens over the wall time from the first request to the last ``[DONE]``), per-stream tokens/s, and
the median and worst time to first token (request sent to the first chunk holding a token). Every figure is
the best of ``--repeats`` rounds after a warm-up round. The CPU is named; prints a table and writes JSON.

    python scripts/bench_serve.py [--tp 1] [--streams 1 4 16] [--out runs/bench_serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _bench


def _folder(args, path: str) -> None:
    import torch
    import transformers

    from tnlg.data.tokenizer import load_tokenizer
    eod = load_tokenizer("builtin").eod_id
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=args.seq,
                                  vocab_size=4096, bos_token_id=eod, eos_token_id=eod)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def _start(path: str, tp: int, max_batch: int):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_bench.ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "serve", "--checkpoint", path, "--tokenizer-model",
                             "builtin", "--port", "0", "--tp", str(tp), "--max-batch", str(max_batch),
                             "--served-model-name", "bench"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if " on http://" in line:
            return proc, line.split(" on ")[1].split(" ")[0]
    raise SystemExit(f"tnlg serve --tp {tp} did not start (exit status {proc.wait()})")


async def _stream(client, url: str, prompt: list[int], new: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, tokens) of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "return_token_ids": True}
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - start
            tokens += len(ids)
    return first or float("nan"), time.perf_counter() - start, tokens


async def _round(url: str, streams: int, args) -> dict:
    import httpx
    prompts = [[(7 * i + 13 * j) % 4000 + 50 for j in range(args.prompt_len)] for i in range(streams)]
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, url, p, args.new_tokens) for p in prompts))
        wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    ttft = [r[0] for r in results]
    return {"streams": streams, "tokens": tokens, "seconds": round(wall, 4), "tokens_per_s": round(tokens / wall, 2),
            "tokens_per_s_per_stream": round(statistics.median(r[2] / r[1] for r in results), 2),
            "ttft_median_s": round(statistics.median(ttft), 4), "ttft_max_s": round(max(ttft), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.add_shape_arguments(p, layers=4, hidden=256, heads=4, seq=256)
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes served (default 1)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16], help="concurrent streams (default 1 4 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per stream (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per figure, the best kept (default 3)")
    p.add_argument("--out", default="runs/bench_serve.json", help="JSON output (default runs/bench_serve.json)")
    args = p.parse_args()
    if args.prompt_len + args.new_tokens > args.seq:
        raise _bench.UserError(f"--prompt-len + --new-tokens ({args.prompt_len + args.new_tokens}) exceed --seq "
                               f"{args.seq}.")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _folder(args, tmp)
        for tp in args.tp:
            proc, url = _start(tmp, tp, max(args.streams))
            try:
                asyncio.run(_round(url, 1, args))  # warm-up
                for streams in args.streams:
                    rounds = [asyncio.run(_round(url, streams, args)) for _ in range(args.repeats)]
                    best = max(rounds, key=lambda r: r["tokens_per_s"])
                    rows.append({"tp": tp, **best})
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    cpu = _bench.cpu_name()
    print(f"tnlg serve, {args.layers} layers x {args.hidden} hidden, prompt {args.prompt_len} + {args.new_tokens} "
          f"new tokens, greedy; CPU: {cpu} ({os.cpu_count()} cores)")
    print(f"{'TP':>3} {'streams':>8} {'tokens/s':>10} {'per stream':>11} {'TTFT med s':>11} {'TTFT max s':>11}")
    for r in rows:
        print(f"{r['tp']:>3} {r['streams']:>8} {r['tokens_per_s']:>10.1f} {r['tokens_per_s_per_stream']:>11.1f} "
              f"{r['ttft_median_s']:>11.3f} {r['ttft_max_s']:>11.3f}")
    _bench.write_json(args.out, {"results": rows, "args": vars(args),
                                 "machine": _bench.machine_info(fastapi=_bench.package_version("fastapi"),
                                                                uvicorn=_bench.package_version("uvicorn"))})
    return 0


if __name__ == "__main__":
    _bench.run(main)
