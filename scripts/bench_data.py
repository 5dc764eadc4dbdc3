"""Data pipeline benchmark: preprocessing throughput and GPT-dataset sample reads.

Measured side by side in one run, on the built-in corpus (Shakespeare + Milton,
split into ~20 KB JSON-Lines documents, repeated ``--repeat`` times; by default as
many times as it takes for one worker's run to last ``--amortise`` (10) times the
workers' start-up, which is measured first and reported on its own line):

* raw SentencePiece encoding of the same texts (``sp.encode(batch, num_threads=1)``:
  the single-core ceiling) and with all cores (``num_threads=0``);
* ``preprocess`` (JSON parsing, encoding, .bin/.idx writing) with 1 and 2 workers, and
  the start-up of the 2-worker pool alone (spawned processes importing the tokenizer:
  the time ``preprocess`` of one tiny document takes with 2 workers beyond 1 worker);
  the 2-worker rate is also given without that start-up;
* random reads of ``seq_length + 1``-token samples from the GPT dataset (whole
  training items: tokens, labels, loss mask), warm page cache.

Targets: 2 workers >= 1.5x one worker; 1 worker >= 80% of raw encoding;
>= 50,000 samples/s of 1025 tokens.

``--mode index`` measures instead what opening a corpus-scale index
costs each rank: a synthetic ``.idx`` of ``--index-docs`` documents (50M by default,
1 GB; the ``.bin`` is a sparse file) is opened in fresh processes, from a cold page
cache (``posix_fadvise(DONTNEED)``) and warm, by the memory-mapping reader and by an
emulation of the previous reader (``f.read()`` of the whole ``.idx``, its per-sequence
int64 arrays, a sha256 of the whole file for the cache key, and the GPT dataset's
per-document arrays). Also measured: building the GPT-dataset index once (rank 0) and
loading it on another rank. Memory is read from ``/proc/self/smaps_rollup``: ``Anonymous``
is private to the rank (heap; what N ranks of a node pay N times); the rest of the
resident increase is page cache of the mapped files, shared by every rank of the node
and reclaimable. Each rate is the best of ``--trials`` runs,
interleaved, so that a briefly busy machine does not decide the result; the load
average is recorded. Tokens per CPU-second (this process plus its pool workers) are
reported beside the wall-clock rates: they show the work per token independently of
other jobs on the machine. Prints a table and writes JSON (``--out``).

    python scripts/bench_data.py [--repeat N] [--trials 3] [--out runs/bench_data.json]
    python scripts/bench_data.py --mode index [--index-docs 50000000] [--out runs/bench_data_index.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time

import _bench
import numpy as np

from tnlg.data.corpus import TOKENIZER_MODEL, corpus_documents, default_dataset
from tnlg.data.gpt_dataset import build_train_valid_test_datasets
from tnlg.data.preprocess import preprocess
from tnlg.data.tokenizer import load_tokenizer


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
    ap.add_argument("--repeat", type=int, default=None, help="copies of the corpus to encode (default: enough "
                    "for one worker's run to last --amortise times the 2-worker start-up, at least 2)")
    ap.add_argument("--amortise", type=float, default=10.0, help="with the default --repeat: the 1-worker run "
                    "lasts this many times the workers' start-up (default 10: 2 ideal workers then reach "
                    "10 / (5 + 1) = 1.67x, above the 1.5x target)")
    ap.add_argument("--doc-chars", type=int, default=20000, help="characters per JSONL document")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--reads", type=int, default=100000, help="random sample reads per trial")
    ap.add_argument("--out", default=None, help="JSON output (default runs/bench_data.json, "
                    "runs/bench_data_index.json with --mode index)")
    ap.add_argument("--mode", choices=("pipeline", "index"), default="pipeline",
                    help="pipeline: preprocessing and sample reads (default); index: per-rank cost of "
                    "opening a corpus-scale index")
    ap.add_argument("--index-docs", type=int, default=50_000_000, help="documents of the synthetic index")
    ap.add_argument("--workdir", default=None, help="where the synthetic index goes (default: a temp folder)")
    ap.add_argument("--_probe", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._probe:
        print(json.dumps(_probe(*args._probe)))
        return 0
    if args.mode == "index":
        results = index_benchmark(args)
        print_index_table(results)
        _bench.write_json(args.out or "runs/bench_data_index.json", results, indent=1)
        return 0
    args.out = args.out or "runs/bench_data.json"

    one_copy = [d for _, text in corpus_documents() for d in split_documents(text, args.doc_chars)]
    tok = load_tokenizer(TOKENIZER_MODEL)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        startup = measure_startup(tmp, tok, args.trials)
        repeat, copy_s = args.repeat, None
        if repeat is None:  # size the input so that start-up is amortised
            t = time.perf_counter()
            tok.sp.encode(one_copy, num_threads=1)
            copy_s = time.perf_counter() - t
            repeat = max(2, min(64, math.ceil(args.amortise * startup["seconds"] / copy_s)))
        docs = one_copy * repeat
        results: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                         "python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_average_before": load_before, "documents": len(docs),
                         "characters": sum(map(len, docs)), "repeat": repeat, "repeat_given": args.repeat,
                         "encode_one_copy_s": copy_s, "startup_2_workers": startup}
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
                timed(f"workers_{w}", lambda w=w: preprocess([path], os.path.join(tmp, f"out{w}"), tok, workers=w,
                                                         progress=False)["tokens"])
        results["tokens"] = n_tokens
        results["tokens_per_s"] = {k: max(v) for k, v in rates.items()}
        # the 2-worker rate without the pool's start-up (what a long preprocessing job sees)
        w2_s = n_tokens / results["tokens_per_s"]["workers_2"]
        results["tokens_per_s"]["workers_2_after_startup"] = n_tokens / max(w2_s - startup["seconds"], 1e-9)
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
                         "workers_2_after_startup_over_1": r["workers_2_after_startup"] / r["workers_1"],
                         "startup_share_of_workers_2_run": startup["seconds"] * r["workers_2"] / n_tokens,
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
         f"{ratio_2_1:.2f}x 1 worker (target >= 1.5x); start-up {startup['seconds']:.2f} s = "
         f"{results['ratios']['startup_share_of_workers_2_run']:.0%} of this run"),
        ("  2 workers without their start-up", m(r["workers_2_after_startup"]), "",
         f"{results['ratios']['workers_2_after_startup_over_1']:.2f}x 1 worker (start-up measured apart)"),
        (f"GPT dataset random reads ({args.seq_length + 1} tokens)", f"{results['samples_per_s']:,.0f} samples/s",
         "", "target >= 50,000"),
        ("  of which token gathering only", f"{results['token_arrays_per_s']:,.0f} samples/s", "", ""),
    ]
    width = max(len(row[0]) for row in rows)
    print(f"data benchmark {results['date']}: {results['documents']} docs ({repeat} copies of the corpus"
          + (f", sized so that one worker runs >= {args.amortise:g}x the 2-worker start-up of "
             f"{startup['seconds']:.2f} s" if args.repeat is None else "") + f"), {n_tokens:,} tokens, "
          f"{results['cpus']} CPUs, load average {results['load_average_before'][0]:.2f} before / "
          f"{results['load_average_after'][0]:.2f} after, best of {args.trials}")
    print(f"| {'measurement'.ljust(width)} | tokens/s (wall) | tokens per CPU-s | note |\n"
          f"|{'-' * (width + 2)}|---|---|---|")
    for a, b, cc, d in rows:
        print(f"| {a.ljust(width)} | {b} | {cc} | {d} |")
    _bench.write_json(args.out, results, indent=1)
    return 0


def measure_startup(tmp: str, tok, trials: int) -> dict:
    """Seconds a 2-worker ``preprocess`` spends starting its pool: the best over ``trials`` of the time it
    takes on one tiny document beyond what 1 worker takes on it (spawned processes, imports, tokenizer)."""
    path = os.path.join(tmp, "tiny.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "To be, or not to be, that is the question."}) + "\n")
    best = {1: float("inf"), 2: float("inf")}
    for i in range(max(1, trials)):
        for w in (1, 2):
            t = time.perf_counter()
            preprocess([path], os.path.join(tmp, f"tiny{w}_{i}"), tok, workers=w, progress=False)
            best[w] = min(best[w], time.perf_counter() - t)
    return {"seconds": max(best[2] - best[1], 0.0), "tiny_1_worker_s": best[1], "tiny_2_workers_s": best[2]}


# ------------------------------------------------------------------------------ --mode index

def write_synthetic_index(prefix: str, n_docs: int, mean_tokens: int = 16, seed: int = 0) -> dict:
    """A Megatron ``.idx`` of ``n_docs`` one-sequence uint16 documents of 1..2*mean-1 tokens, written in
    chunks; the ``.bin`` is a sparse file of the right size (its contents are never needed to open it)."""
    from tnlg.data.indexed import MAGIC
    rng = np.random.default_rng(seed)
    chunk = 1 << 22
    lengths_path = prefix + ".lengths.tmp"
    total = 0
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, 8, n_docs, n_docs + 1))
        with open(lengths_path, "wb") as lf:
            for a in range(0, n_docs, chunk):
                lengths = rng.integers(1, 2 * mean_tokens, size=min(chunk, n_docs - a), dtype=np.int32)
                lengths.tofile(f)
                lengths.tofile(lf)
        lengths = np.memmap(lengths_path, dtype=np.int32, mode="r")
        for a in range(0, n_docs, chunk):  # byte pointers: exclusive cumulative sum of 2 * length
            part = lengths[a:a + chunk].astype(np.int64) * 2
            (np.cumsum(part) - part + total).tofile(f)
            total += int(part.sum())
        del lengths
        for a in range(0, n_docs + 1, chunk):
            np.arange(a, min(a + chunk, n_docs + 1), dtype=np.int64).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.remove(lengths_path)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(total)
    return {"documents": n_docs, "idx_bytes": os.path.getsize(prefix + ".idx"), "bin_bytes": total,
            "tokens": total // 2}


def _drop_page_cache(prefix: str) -> None:
    """Evict the two files from the page cache (just these files; nothing else on the machine)."""
    for ext in (".idx", ".bin"):
        fd = os.open(prefix + ext, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _smaps() -> dict:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _legacy_open(prefix: str) -> list:
    """What the memory-mapped reader replaced, per rank, kept to compare against: read the
    whole .idx, build int64 arrays per sequence, sha256 the whole .idx (cache key), and the GPT dataset's
    per-document arrays (``_Units``). Returns the objects that stayed alive."""
    import hashlib
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    s, d = struct.unpack_from("<QQ", idx, 18)
    lengths = np.frombuffer(idx, np.int32, s, 34)
    pointers = np.frombuffer(idx, np.int64, s, 34 + 4 * s)
    doc = np.frombuffer(idx, np.int64, d, 34 + 12 * s)
    assert not (lengths < 0).any() and not (np.diff(doc) < 0).any()
    ends = pointers + lengths.astype(np.int64) * 2
    assert int(ends.max()) <= os.path.getsize(prefix + ".bin") and not (pointers % 2).any()
    offsets = (pointers // 2).astype(np.int64)
    h = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    lengths64 = lengths.astype(np.int64)
    cum = np.zeros(len(lengths64) + 1, dtype=np.int64)
    np.cumsum(lengths64, out=cum[1:])
    unit_offsets = pointers // 2
    assert np.array_equal(unit_offsets, cum[:-1])
    start = cum[doc[:-1]]
    size = cum[doc[1:]] - start
    return [idx, offsets, h.hexdigest(), lengths64, cum, unit_offsets, start, size, np.arange(len(doc))]


def _probe(kind: str, prefix: str, cache: str) -> dict:
    """Run in a fresh process: the cost of one way of opening, as seen by one rank."""
    import resource

    from tnlg.data import gpt_dataset as gd
    from tnlg.data.indexed import IndexedDataset
    from tnlg.parallel.heap import release_freed_memory
    release_freed_memory()
    before = _smaps()
    t0 = time.perf_counter()
    if kind == "mapped":
        ds = IndexedDataset(prefix)
        keep = [ds, gd._units_of(ds), ds.fingerprint()]
    elif kind == "legacy":
        keep = _legacy_open(prefix)
    elif kind in ("gpt_build", "gpt_load"):
        train, _, _ = gd.build_train_valid_test_datasets([prefix], "100,0,0", 1024, (500_000, 0, 0), seed=1234,
                                                        cache_dir=cache)
        rng = np.random.RandomState(0)
        for i in rng.randint(0, len(train), 1000).tolist():
            train[i]
        keep = [train]
    else:
        raise ValueError(kind)
    seconds = time.perf_counter() - t0
    release_freed_memory()
    after = _smaps()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del keep
    grow = {k: after.get(k, 0) - before.get(k, 0) for k in ("Rss", "Pss", "Anonymous", "Private_Dirty",
                                                            "Private_Clean", "Shared_Clean")}
    return {"kind": kind, "seconds": seconds, "increase_bytes": grow, "peak_rss_increase_bytes": peak - before["Rss"]}


def index_benchmark(args) -> dict:
    if not os.path.exists("/proc/self/smaps_rollup"):
        raise SystemExit("--mode index needs Linux (/proc/self/smaps_rollup)")
    results: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "mode": "index",
                     "python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                     "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        prefix = os.path.join(tmp, "synthetic_text_document")
        t = time.perf_counter()
        results["corpus"] = write_synthetic_index(prefix, args.index_docs)
        results["corpus"]["write_seconds"] = time.perf_counter() - t
        cache = os.path.join(tmp, "index-cache")
        runs = []
        plan = [("mapped", True), ("legacy", True), ("mapped", False), ("legacy", False),
                ("gpt_build", True), ("gpt_load", True), ("gpt_load", False)]
        for kind, cold in plan:
            if cold:
                _drop_page_cache(prefix)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_probe", kind, prefix, cache],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["page_cache"] = "cold" if cold else "warm"
            runs.append(r)
            print(f"  {kind:9s} {r['page_cache']}: {r['seconds']:.2f} s, private "
                  f"{r['increase_bytes']['Anonymous'] / 2**20:,.1f} MiB", flush=True)
        results["runs"] = runs
    results["load_average_after"] = os.getloadavg()
    return results


def print_index_table(results: dict) -> None:
    c = results["corpus"]
    print(f"index benchmark {results['date']}: {c['documents']:,} documents, .idx {c['idx_bytes'] / 2**30:.2f} GiB, "
          f".bin {c['bin_bytes'] / 2**30:.2f} GiB (sparse), {results['cpus']} CPUs, load average "
          f"{results['load_average_before'][0]:.2f} before / {results['load_average_after'][0]:.2f} after")
    names = {"mapped": "open, memory-mapped (now)", "legacy": "open, read + hash (before)",
             "gpt_build": "GPT index build, rank 0, once", "gpt_load": "GPT dataset load, other ranks"}
    print("| what | page cache | time | private (Anonymous) | resident increase (RSS) | peak RSS increase |\n"
          "|---|---|---|---|---|---|")
    mib = 2 ** 20
    for r in results["runs"]:
        g = r["increase_bytes"]
        print(f"| {names[r['kind']]} | {r['page_cache']} | {r['seconds']:.2f} s | {g['Anonymous'] / mib:,.1f} MiB | "
              f"{g['Rss'] / mib:,.1f} MiB | {r['peak_rss_increase_bytes'] / mib:,.1f} MiB |")


if __name__ == "__main__":
    sys.exit(main())
