"""Data pipeline benchmark: preprocessing throughput and GPT-dataset sample reads.

Measured side by side in one run, on the built-in corpus (Shakespeare + Milton,
split into ~20 KB JSON-Lines documents, repeated ``--repeat`` times):

* raw SentencePiece encoding of the same texts (``sp.encode(batch, num_threads=1)``:
  the single-core ceiling) and with all cores (``num_threads=0``);
* ``preprocess`` (JSON parsing, encoding, .bin/.idx writing) with 1 and 2 workers;
* random reads of ``seq_length + 1``-token samples from the GPT dataset (whole
  training items: tokens, labels, loss mask), warm page cache.

Targets (issue 3): 2 workers >= 1.5x one worker; 1 worker >= 80% of raw encoding;
>= 50,000 samples/s of 1025 tokens. Each rate is the best of ``--trials`` runs,
interleaved, so that a briefly busy machine does not decide the result; the load
average is recorded. Tokens per CPU-second (this process plus its pool workers) are
reported beside the wall-clock rates: they show the work per token independently of
other jobs on the machine. Prints a table and writes JSON (``--out``).

    python scripts/bench_data.py [--repeat 2] [--trials 3] [--out runs/bench_data.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tnlg.data.corpus import TOKENIZER_MODEL, corpus_documents, default_dataset  # noqa: E402
from tnlg.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from tnlg.data.preprocess import preprocess  # noqa: E402
from tnlg.data.tokenizer import load_tokenizer  # noqa: E402


def split_documents(text: str, size: int) -> list[str]:
    """Cut a text at paragraph breaks into pieces of about ``size`` characters."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + size)
        end = len(text) if end < 0 else end + 2
        out.append(text[start:end])
        start = end
    return out


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the pool workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2, help="copies of the corpus to encode (default 2)")
    ap.add_argument("--doc-chars", type=int, default=20000, help="characters per JSONL document")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--reads", type=int, default=100000, help="random sample reads per trial")
    ap.add_argument("--out", default="runs/bench_data.json")
    args = ap.parse_args()

    docs = [d for _, text in corpus_documents() for d in split_documents(text, args.doc_chars)] * args.repeat
    tok = load_tokenizer(TOKENIZER_MODEL)
    results: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "python": platform.python_version(), "cpus": os.cpu_count(),
                     "load_average_before": os.getloadavg(), "documents": len(docs),
                     "characters": sum(map(len, docs))}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        keys = ("raw_1thread", "raw_all_threads", "workers_1", "workers_2")
        rates: dict[str, list[float]] = {k: [] for k in keys}
        cpu_rates: dict[str, list[float]] = {k: [] for k in keys}  # tokens per CPU-second, all processes
        n_tokens = 0

        def timed(key, fn):
            c0, t0 = _cpu(), time.perf_counter()
            n = fn()
            rates[key].append(n / (time.perf_counter() - t0))
            cpu_rates[key].append(n / max(_cpu() - c0, 1e-9))
            return n

        for _ in range(args.trials):
            n_tokens = timed("raw_1thread", lambda: sum(map(len, tok.sp.encode(docs, num_threads=1))))
            timed("raw_all_threads", lambda: sum(map(len, tok.sp.encode(docs, num_threads=0))))
            for w in (1, 2):  # includes the input checks and writing the files
                timed(f"workers_{w}", lambda: preprocess([path], os.path.join(tmp, f"out{w}"), tok, workers=w,
                                                         progress=False)["tokens"])
        results["tokens"] = n_tokens
        results["tokens_per_s"] = {k: max(v) for k, v in rates.items()}
        results["tokens_per_cpu_s"] = {k: max(v) for k, v in cpu_rates.items()}
        results["tokens_per_s_all_trials"] = rates

        prefix, _ = default_dataset(os.path.join(tmp, "cache"))
        train, _, _ = build_train_valid_test_datasets([prefix], "100,0,0", args.seq_length, (args.reads, 0, 0),
                                                      seed=1234, cache_dir=os.path.join(tmp, "idx"))
        rng = np.random.RandomState(0)
        read_rates, raw_rates = [], []
        for _ in range(args.trials):
            idx = rng.randint(0, len(train), args.reads).tolist()
            for i in idx[:1000]:
                train[i]  # warm up
            t = time.perf_counter()
            for i in idx:
                train[i]
            read_rates.append(len(idx) / (time.perf_counter() - t))
            t = time.perf_counter()
            for i in idx:
                train.get_tokens(i)
            raw_rates.append(len(idx) / (time.perf_counter() - t))
        results["samples_per_s"] = max(read_rates)
        results["token_arrays_per_s"] = max(raw_rates)
        results["sample_tokens"] = args.seq_length + 1
    results["load_average_after"] = os.getloadavg()

    r, c = results["tokens_per_s"], results["tokens_per_cpu_s"]
    ratio_2_1 = r["workers_2"] / r["workers_1"]
    ratio_1_raw = r["workers_1"] / r["raw_1thread"]
    cpu_1_raw = c["workers_1"] / c["raw_1thread"]
    results["ratios"] = {"workers_2_over_1": ratio_2_1, "workers_1_over_raw_1thread": ratio_1_raw,
                         "cpu_efficiency_workers_1_over_raw": cpu_1_raw,
                         "cpu_efficiency_workers_2_over_raw": c["workers_2"] / c["raw_1thread"]}

    def m(x):
        return f"{x / 1e6:.2f} M"
    rows = [
        ("raw SentencePiece encode, 1 thread", m(r["raw_1thread"]), m(c["raw_1thread"]), "reference"),
        ("raw SentencePiece encode, all threads", m(r["raw_all_threads"]), m(c["raw_all_threads"]), ""),
        ("preprocess, 1 worker", m(r["workers_1"]), m(c["workers_1"]),
         f"{ratio_1_raw:.0%} of raw wall rate, {cpu_1_raw:.0%} per CPU-s (target >= 80%)"),
        ("preprocess, 2 workers", m(r["workers_2"]), m(c["workers_2"]),
         f"{ratio_2_1:.2f}x 1 worker (target >= 1.5x)"),
        (f"GPT dataset random reads ({args.seq_length + 1} tokens)", f"{results['samples_per_s']:,.0f} samples/s",
         "", "target >= 50,000"),
        ("  of which token gathering only", f"{results['token_arrays_per_s']:,.0f} samples/s", "", ""),
    ]
    width = max(len(row[0]) for row in rows)
    print(f"data benchmark {results['date']}: {results['documents']} docs, {n_tokens:,} tokens, "
          f"{results['cpus']} CPUs, load average {results['load_average_before'][0]:.2f} before / "
          f"{results['load_average_after'][0]:.2f} after, best of {args.trials}")
    print(f"| {'measurement'.ljust(width)} | tokens/s (wall) | tokens per CPU-s | note |\n"
          f"|{'-' * (width + 2)}|---|---|---|")
    for a, b, cc, d in rows:
        print(f"| {a.ljust(width)} | {b} | {cc} | {d} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
