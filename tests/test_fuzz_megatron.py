"""Fuzzing the Megatron import: seeded random mutations of valid checkpoints (tests/fuzz_megatron.py says
which) read in a child process under a memory limit (``RLIMIT_AS``), a time budget per file and an audit
of every file it opens. Each mutated file must end in success or one paragraph (:class:`UserError`):
never a traceback, a hang, unbounded memory, a read outside the checkpoint or debris in the destination.

Three readers: the legacy rank file (``model_optim_rng.pt``), the ``torch_dist`` index (``.metadata``) and
its data file's chunks (``.distcp``). The quick set reads 100 mutated files of each; the slow one 400
more of each, other seeds.
"""

import os
import resource
import subprocess
import sys

import pytest

from tests.fresh_checkpoint import fresh_checkpoint
from tnlg.config import GPTConfig
from tnlg.interop.megatron import checkpoint_to_megatron

HERE = os.path.dirname(os.path.abspath(__file__))
MEMORY = 3 << 30  # the child's address space (torch alone maps about 0.7 GB)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A valid legacy and torch_dist Megatron checkpoint of a tiny model (TP 1)."""
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32)
    root = tmp_path_factory.mktemp("fuzz_base")
    ckpt = fresh_checkpoint(str(root / "tnlg"), cfg)
    for fmt in ("legacy", "torch_dist"):
        checkpoint_to_megatron(ckpt, str(root / fmt), fmt=fmt, tp=1)
    return root


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _fuzz(base, work, seed: int, count: int, readers=("legacy", "index", "chunks"), timeout: int = 600):
    """Each reader's mutations in a child of its own, side by side (each is one core's work; a case's mutation is
    seeded by seed, reader and number alone, so the files are the ones one child would make)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    children = []
    try:
        for reader in readers:
            (work / reader).mkdir(parents=True)
            children.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "fuzz_megatron.py"), str(base), str(work / reader), str(seed),
                 str(count), reader], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_limit,
                env=env))
        lines = []
        for reader, child in zip(readers, children):
            out, err = child.communicate(timeout=timeout)
            mine = out.splitlines()
            bad = [line for line in mine if line.startswith("BAD")]
            last = next((line for line in reversed(mine) if line.startswith("BEGIN")), "")
            assert child.returncode == 0 and not bad, (
                f"{reader}: exit {child.returncode}; {len(bad)} bad outcomes:\n" + "\n".join(bad[:5])
                + f"\nlast file: {last}\nstderr: {err[-3000:]}")
            lines += mine
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    done = [line for line in lines if line.startswith("DONE")]
    assert len(done) == len(readers), "\n".join(lines[-20:])
    for line in done:  # both outcomes occur: the mutations reach past the first check, and are refused
        counts = dict(item.split("=") for item in line.split()[2:])
        assert int(counts["ok"]) + int(counts["refused"]) == count and int(counts["refused"]) > count // 4, line
    return done


def test_fuzz_quick(base, tmp_path):
    print(_fuzz(base, tmp_path / "work", seed=1, count=100))


@pytest.mark.slow
def test_fuzz_more_seeds(base, tmp_path):
    print(_fuzz(base, tmp_path / "work", seed=2, count=400))


_AUDIT = """
import os, sys
sys.pycache_prefix = sys.argv[1]  # as PYTHONPYCACHEPREFIX sets it
from tests.fuzz_megatron import Watch
watch = Watch([sys.argv[2]])
watch.on = True
cache = os.path.join(sys.argv[1], "lib", "python3", "encodings")
os.makedirs(cache)
for name in ("latin_1.cpython-311.pyc.140449994481440", "latin_1.cpython-311.pyc"):  # a lazy import's write
    open(os.path.join(cache, name), "w").close()
open(os.path.join(sys.argv[2], "model_optim_rng.pt"), "w").close()  # the checkpoint's own file
open(sys.argv[3], "w").close()  # a file outside both: recorded
print(watch.outside)
"""


def test_the_audit_allows_a_lazy_imports_bytecode_under_the_cache_prefix_and_nothing_else(tmp_path):
    """The reader's file audit (tests/fuzz_megatron.py's ``Watch``) in a process whose bytecode cache is apart
    (``PYTHONPYCACHEPREFIX``): a lazy import's bytecode written there (a temporary name, then the ``.pyc``) is no
    read outside the checkpoint; any other file outside it still is (a user's prefix failed the fuzzer)."""
    (tmp_path / "ckpt").mkdir()
    outside = tmp_path / "canary.distcp"
    proc = subprocess.run([sys.executable, "-c", _AUDIT, str(tmp_path / "bytecode"), str(tmp_path / "ckpt"),
                           str(outside)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(HERE), env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == repr([str(outside)]), proc.stdout
