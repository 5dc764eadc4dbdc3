"""Fuzzing the Hugging Face folder reader (``tnlg.interop.hf_reader.read_hf_folder``, what ``tnlg convert
--from hf``, ``tnlg.load`` and ``tnlg generate`` read a folder with).

Seeded random mutations of four valid tiny folders (a Llama in one ``model.safetensors``, in safetensors
shards behind ``model.safetensors.index.json``, and in one ``pytorch_model.bin``; a tied GPT-2): ``config.json`` with a value swapped
for another type, size or nesting (tests/test_fuzz_readers.py's JSON mutations); a safetensors header
with a dtype, shape or byte range swapped, its length field replaced (0, 2^62, past the file), or the
header's JSON mutated; the index's JSON mutated or a shard name replaced by ``../canary``, an absolute
path, ``..`` or a link out of the folder; any file truncated, bit-flipped, zeroed or with bytes inserted.
All mutations run in one child process under ``resource.setrlimit`` caps (address space, CPU time), each
with a time budget; every open outside the folder is seen by an audit hook. Each must end in success or
one :class:`tnlg.errors.UserError` paragraph: never another exception, a hang, memory past the cap or a
read outside the folder.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_CAP = 3 * 2**30   # address space of the child (torch and transformers reserve more than they touch)
PER_CASE_S = 3.0         # the budget of one mutated folder (a loaded CI machine)
CHILD_TIMEOUT_S = 120
COUNT = 400              # cheap: most end at a header or config check (the imports dominate)
_OUTSIDE = ("../canary", "../../canary", "/etc/passwd", "a/../../canary", "link-out", "", ".", "..", "x" * 300)


# ---------------------------------------------------------------- in the child process

def _mutate_header(rng, data: bytes) -> bytes:
    """A safetensors file whose header has one tensor's dtype, shape or offsets swapped, its length field
    replaced, or its JSON mutated (the length then rewritten to match)."""
    from tests.test_fuzz_readers import _mutate_json
    n = struct.unpack("<Q", data[:8])[0]
    header, rest = json.loads(data[8:8 + n]), data[8 + n:]
    how = rng.randrange(4)
    if how == 0:
        return struct.pack("<Q", rng.choice((0, 1, 2**62, 2**64 - 1, len(data), len(data) - 7, n + 1))) + data[8:]
    names = [k for k in header if k != "__metadata__"]
    entry = header[rng.choice(names)]
    if how == 1:
        entry["dtype"] = rng.choice(("F16", "BF16", "F64", "I8", "U8", "F8_E4M3", "BOOL", 7, None))
    elif how == 2:
        other = header[rng.choice(names)]["shape"]
        entry["shape"] = rng.choice((other, entry["shape"][::-1], [], [0], [-1, 2], [2**40, 2**40], "x"))
    else:
        text = _mutate_json(rng, json.dumps(header), ())
        return struct.pack("<Q", len(text)) + text.encode() + rest
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + rest


def _mutate_index(rng, data: bytes) -> bytes:
    from tests.test_fuzz_readers import _mutate_json
    doc = json.loads(data)
    if rng.random() < 0.4:
        name = rng.choice(list(doc["weight_map"]))
        doc["weight_map"][name] = rng.choice(_OUTSIDE)
        return json.dumps(doc).encode()
    return _mutate_json(rng, json.dumps(doc), ()).encode()


def _mutate(rng, name: str, data: bytes) -> bytes:
    from tests.test_fuzz_readers import _mutate_bytes, _mutate_json
    if name == "config.json" and rng.random() < 0.8:
        return _mutate_json(rng, data.decode(), ()).encode()
    if name.endswith(".index.json") and rng.random() < 0.8:
        return _mutate_index(rng, data)
    if name.endswith(".safetensors") and rng.random() < 0.7:
        return _mutate_header(rng, data)
    return _mutate_bytes(rng, data)


def child(seeds: list[str], work: str, n: int, seed: int) -> dict:
    """Run ``n`` mutations of the seed folders in ``work``; the summary of what each ended in."""
    import random
    import resource
    import shutil

    from tests.test_fuzz_readers import _watch_opens, judge
    from tnlg.interop.hf_reader import read_hf_folder
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_TIMEOUT_S, CHILD_TIMEOUT_S))
    sys.setrecursionlimit(10000)
    root = os.path.realpath(work)
    case = os.path.join(root, "case")
    open(os.path.join(root, "canary"), "wb").write(open(os.path.join(seeds[0], "model.safetensors"), "rb").read())
    for folder in seeds:  # each seed reads (imports done, the timing is the reader's)
        read_hf_folder(folder)
    counts = {"ok": 0, "user_error": 0}
    seen: list = []
    _watch_opens(case, root, seen)
    failures = []
    rng = random.Random(seed)
    for i in range(n):
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(rng.choice(seeds), case)
        os.symlink(os.path.join(root, "canary"), os.path.join(case, "link-out"))
        name = rng.choice(sorted(f for f in os.listdir(case) if f != "link-out"))
        path = os.path.join(case, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(_mutate(rng, name, data))
        judge(lambda: read_hf_folder(case), f"#{i} {name}", counts, failures, seen, PER_CASE_S)
    return dict(counts, failures=failures[:20], n_failures=len(failures))


# ---------------------------------------------------------------- the test

def _seeds(tmp_path) -> list[str]:
    import torch

    from .hf_reference import random_gpt2
    from .llama_reference import random_llama
    hf = random_llama("llama", layers=2, hidden=24, heads=4, groups=2, ffn=32, vocab=40, seq=16)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    os.makedirs(tmp_path / "bin")
    (tmp_path / "bin" / "config.json").write_bytes((tmp_path / "single" / "config.json").read_bytes())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    random_gpt2(40, 16, n_embd=24, n_head=4, n_layer=2).save_pretrained(tmp_path / "gpt2")
    for name in ("single", "sharded", "gpt2"):
        gen = tmp_path / name / "generation_config.json"
        if gen.exists():
            gen.unlink()
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    return [str(tmp_path / n) for n in ("single", "sharded", "bin", "gpt2")]


@pytest.mark.usefixtures("one_thread")
def test_mutated_hf_folders_end_in_success_or_one_paragraph(tmp_path):
    seeds = _seeds(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.test_fuzz_hf", json.dumps(seeds), str(work), str(COUNT),
                           "1234"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S + 30)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] + summary["user_error"] == COUNT and summary["n_failures"] == 0, \
        "\n\n".join(summary["failures"])
    assert summary["user_error"] >= COUNT // 3 and summary["ok"] >= 1, summary  # the mutations reach the checks


if __name__ == "__main__":
    seeds, work, n, seed = sys.argv[1:5]
    print(json.dumps(child(json.loads(seeds), work, int(n), int(seed))))
