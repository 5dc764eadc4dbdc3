"""Fuzzing the readers of files from strangers: ``meta.json`` (a checkpoint's manifest, as ``--load`` and
``tnlg checkpoint info`` read it), JSON Lines and ``.txt`` inputs, Parquet files and ``datasets`` folders
(as ``tnlg preprocess`` checks and reads them, each document then encoded by SentencePiece).

Each reader gets seeded random mutations of a valid file: truncation, byte flips, inserted and zeroed
bytes, and for JSON a value swapped for another type (a string, a negative or huge number, NaN, a list,
null), a value nested 10^4-10^5 deep, a file name replaced by ``../canary``, an absolute path or a
symbolic link out of the folder. All mutations of one reader run in one child process under
``resource.setrlimit`` caps (address space and CPU time), each with a time budget; every open of a
canary file beside the folder (or of ``/etc/passwd``) is seen by an audit hook (``sys.addaudithook``).
Each mutation must end in success or one :class:`tnlg.errors.UserError`: never another exception, a
hang, memory beyond the cap or a read outside the folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "checkpoint_v1", "iter_0000003")
MEMORY_CAP = 6 * 2**30   # address space of the child (torch and pyarrow reserve much more than they touch)
PER_FILE_S = 3.0         # the budget of one mutated file (a loaded CI machine)
CHILD_TIMEOUT_S = 150


# ---------------------------------------------------------------- in the child process

def _mutate_bytes(rng, data: bytes) -> bytes:
    b = bytearray(data)
    how = rng.randrange(5)
    if how == 0 or not b:
        return bytes(b[:rng.randrange(len(b) + 1)])  # truncated
    if how == 1:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)  # bit flips
        return bytes(b)
    if how == 2:
        at = rng.randrange(len(b))
        return bytes(b[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + b[at:])  # inserted
    if how == 3:
        at, size = rng.randrange(len(b)), rng.randint(1, 256)
        b[at:at + size] = bytes(len(b[at:at + size]))  # zeroed
        return bytes(b)
    a, c = sorted(rng.randrange(len(b)) for _ in range(2))
    return bytes(b[:c] + b[a:c] + b[c:])  # a chunk repeated


def _nodes(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nodes(v, path + (i,))


def _replaced(value, path, new):
    if not path:
        return new
    out = dict(value) if isinstance(value, dict) else list(value)
    out[path[0]] = _replaced(value[path[0]], path[1:], new)
    return out


_OUTSIDE = ("../canary", "../../canary", "/etc/passwd", "a/../../canary", "link-out", "", ".", "..", "x" * 300)


def _swap(rng, value):
    """Another value for a JSON node (one of the mutations of JSON files)."""
    choice = rng.randrange(12)
    if choice == 11:
        return ("NEST", rng.choice((10**4, 10**5)))
    return [str(value), -5, -(2**63), 10**30, 2**64, 1.5, float("nan"), [value], {"k": value}, None, True][choice]


def _mutate_json(rng, text: str, names: tuple) -> str:
    """A JSON document with one node swapped, or a key of one of the ``names`` sections (or a value under a
    ``filename`` key) replaced by a name outside the folder."""
    doc = json.loads(text)
    nodes = list(_nodes(doc))
    if rng.random() < 0.3:
        targets = [p for p in nodes if p and (p[-1] == "filename" or (len(p) >= 2 and p[-2] in names))]
        if targets:
            p = rng.choice(targets)
            name = rng.choice(_OUTSIDE)
            if p[-1] == "filename":
                doc = _replaced(doc, p, name)
            else:
                parent = _get(doc, p[:-1])
                doc = _replaced(doc, p[:-1], {**{k: v for k, v in parent.items() if k != p[-1]},
                                              name: parent[p[-1]]})
            return json.dumps(doc)
    p = rng.choice(nodes)
    new = _swap(rng, _get(doc, p))
    if isinstance(new, tuple):  # deep nesting, written as text (json.dumps would recurse)
        out = json.dumps(_replaced(doc, p, "@NEST@"))
        return out.replace('"@NEST@"', "[" * new[1] + "]" * new[1])
    return json.dumps(_replaced(doc, p, new))


def _get(value, path):
    for k in path:
        value = value[k]
    return value


def _mutation(rng, data: bytes, is_json: bool, names: tuple) -> bytes:
    if is_json and rng.random() < 0.6:
        try:
            return _mutate_json(rng, data.decode(), names).encode()
        except (ValueError, RecursionError):  # (the seed line is not JSON: bytes then)
            pass
    return _mutate_bytes(rng, data)


def _watch_opens(case: str, root: str, seen: list) -> None:
    """Record every open of a path inside ``root`` but outside ``case`` (the canary beside the folder) and
    of /etc/passwd."""
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path == "/etc/passwd" or (path.startswith(root + os.sep) and not path.startswith(case + os.sep)
                                         and path != case):
                seen.append(path)
    sys.addaudithook(hook)


def _sp():
    import sentencepiece as spm

    from tnlg.data.tokenizer import builtin_tokenizer_path
    return spm.SentencePieceProcessor(model_file=builtin_tokenizer_path())


def _read_documents(target: str, sp) -> None:
    from tnlg.data.inputs import check_inputs, iter_documents
    check_inputs([target], ["text"])
    for _, _, text in iter_documents([target], ["text"]):
        sp.encode(text)


def _read_manifest(target: str) -> None:
    import io

    from tnlg.checkpoint import files as F
    from tnlg.checkpoint.info import info
    from tnlg.checkpoint.manifest import Manifest
    m = Manifest.read(target)
    F.check_files(target, m)
    _ = m.schedule_steps, m.has_optimizer, int(m.iteration), int(m.consumed_samples)
    info(target, out=io.StringIO())
    info(target, as_json=True, out=io.StringIO())


def judge(read, label: str, counts: dict, failures: list, seen: list, limit_s: float) -> None:
    """Read one mutated case (``read()``): a success or one :class:`UserError` paragraph is counted in
    ``counts``; anything else, a message of several lines, a read over ``limit_s`` or a file opened outside
    the case (``seen``, :func:`_watch_opens`) is a failure named by ``label``."""
    import time
    import traceback

    from tnlg.errors import UserError
    t0 = time.monotonic()
    try:
        read()
        counts["ok"] += 1
    except UserError as err:
        counts["user_error"] += 1
        if "\n" in str(err):
            failures.append(f"{label}: a message of several lines: {str(err)[:300]!r}")
    except BaseException as err:  # noqa: BLE001 - what the test is looking for
        failures.append(f"{label}: {type(err).__name__}: {str(err)[:200]}\n"
                        + "".join(traceback.format_exc(limit=-4))[-1500:])
    took = time.monotonic() - t0
    if took > limit_s:
        failures.append(f"{label}: took {took:.1f} s")
    if seen:
        failures.append(f"{label}: opened {sorted(set(seen))} outside the folder")
        seen.clear()


def child(reader: str, seed_dir: str, work: str, n: int, seed: int) -> dict:
    """Run ``n`` mutations of ``reader``'s seed in ``work``; the summary of what each ended in."""
    import random
    import resource
    import shutil

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_TIMEOUT_S, CHILD_TIMEOUT_S))
    sys.setrecursionlimit(10000)  # what a deep structure meets, as in any program that raised it
    spec = READERS[reader]
    sp = _sp() if reader != "meta" else None
    root = os.path.realpath(work)
    case = os.path.join(root, "case")
    open(os.path.join(root, "canary"), "w").write('{"text": "outside"}\n')
    warm = os.path.join(root, "warm")
    shutil.copytree(seed_dir, warm)
    _read_manifest(warm) if reader == "meta" else _read_documents(os.path.join(warm, spec["target"]), sp)
    counts = {"ok": 0, "user_error": 0}  # (the seed itself reads: imports done, the timing is the reader's)
    seen: list = []
    _watch_opens(case, root, seen)
    failures = []
    rng = random.Random(seed)
    for i in range(n):
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(seed_dir, case, symlinks=True)
        os.symlink(os.path.join(root, "canary"), os.path.join(case, "link-out"))
        name = rng.choice(spec["mutate"])
        path = os.path.join(case, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(_mutation(rng, data, name.endswith((".json", ".jsonl")), spec["names"]))
        target = os.path.join(case, spec["target"]) if spec["target"] else case
        judge(lambda target=target: _read_manifest(target) if reader == "meta" else _read_documents(target, sp),
              f"#{i} {name}", counts, failures, seen, PER_FILE_S)
    return dict(counts, failures=failures[:20], n_failures=len(failures))


# ---------------------------------------------------------------- the seeds

def _seed_meta(tmp_path) -> str:
    import shutil
    folder = tmp_path / "seed"
    shutil.copytree(FIXTURE, folder)
    return str(folder)


def _seed_text(tmp_path) -> str:
    folder = tmp_path / "seed"
    folder.mkdir()
    docs = ["First document.", "accents é à ü, emoji 🎭", "x" * 200, "tabs\tand\r\nline ends", ""]
    (folder / "d.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    (folder / "d.txt").write_text("One document\nof two lines, é.\n")
    return str(folder)


def _seed_parquet(tmp_path) -> str:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "seed"
    folder.mkdir()
    texts = [f"document {i} " + "words " * (i % 7) for i in range(40)]
    pq.write_table(pa.table({"id": list(range(40)), "text": texts}), str(folder / "d.parquet"), row_group_size=10)
    return str(folder)


def _seed_datasets(tmp_path) -> str:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "seed"
    texts = [f"document {i} " + "words " * (i % 7) for i in range(40)]
    datasets.Dataset.from_dict({"id": list(range(40)), "text": texts}).save_to_disk(str(folder / "ds"), num_shards=2)
    return str(folder)


# reader -> the files mutated, the file or folder read, the sections whose keys are file names, the seed
READERS = {
    "meta": dict(mutate=["meta.json"], target="", names=("files", "sha256", "optim_files"), seed=_seed_meta),
    "jsonl": dict(mutate=["d.jsonl"], target="d.jsonl", names=(), seed=_seed_text),
    "txt": dict(mutate=["d.txt"], target="d.txt", names=(), seed=_seed_text),
    "parquet": dict(mutate=["d.parquet"], target="d.parquet", names=(), seed=_seed_parquet),
    "datasets": dict(mutate=["ds/state.json", "ds/state.json", "ds/data-00000-of-00002.arrow",
                             "ds/data-00001-of-00002.arrow"], target="ds", names=(), seed=_seed_datasets),
}
COUNTS = {"meta": 600, "jsonl": 600, "txt": 500, "parquet": 500, "datasets": 600}


# ---------------------------------------------------------------- the tests

_NEEDS = {"parquet": ("pyarrow",), "datasets": ("pyarrow", "datasets")}  # optional packages of a reader


@pytest.mark.parametrize("reader", [pytest.param(r, marks=pytest.mark.needs_package(*_NEEDS[r])) if r in _NEEDS
                                    else r for r in READERS])
def test_mutated_files_end_in_success_or_one_paragraph(tmp_path, reader):
    seed_dir = READERS[reader]["seed"](tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.test_fuzz_readers", reader, seed_dir, str(work),
                           str(COUNTS[reader]), "1234"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S + 30)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] + summary["user_error"] == COUNTS[reader] and summary["n_failures"] == 0, \
        "\n\n".join(summary["failures"])
    assert summary["user_error"] >= COUNTS[reader] // 10, summary  # the mutations do reach the checks


if __name__ == "__main__":
    reader, seed_dir, work, n, seed = sys.argv[1:6]
    print(json.dumps(child(reader, seed_dir, work, int(n), int(seed))))
