"""What a process loads and does not use: ``torch._dynamo`` (about 1.3 CPU-s per process, so 2.65 CPU-s
instead of 1.35 for a worker to start) is imported by ``torch.compiler.disable`` applied at import time and
by ``torch.distributed.pipelining``, and by the methods of torch's optimizer objects (``torch/_compile.py``'s
``_disable_dynamo``, on first call); neither the library's import nor a ``tnlg pretrain`` worker that
neither compiles nor pipelines may load it (the ZeRO engines step torch's functional AdamW). A
``sitecustomize`` of the test's own records every process that imports it, with the stack that did."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.tiny import tiny_flags
from tnlg.runtime.spawn import checkout_env, run_tnlg

_HOOK = '''
import os, sys, traceback

class _RecordDynamo:
    """Notes the first import of torch._dynamo in this process (pid and stack), then lets it go on."""
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo":
            with open(os.environ["TNLG_TEST_DYNAMO_LOG"], "a") as f:
                f.write(chr(30) + f"pid {os.getpid()} argv {sys.argv}\\n{''.join(traceback.format_stack(limit=14))}\\n")
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, _RecordDynamo())
'''


def _env(tmp_path) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HOOK)
    env = checkout_env(TNLG_TEST_DYNAMO_LOG=str(tmp_path / "dynamo.log"))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env


def _log(tmp_path) -> str:
    path = tmp_path / "dynamo.log"
    return path.read_text() if path.exists() else ""


def test_the_library_and_a_pretrain_worker_do_not_load_dynamo(tmp_path):
    env = _env(tmp_path)
    modules = ("tnlg", "tnlg.model", "tnlg.parallel.context", "tnlg.training", "tnlg.training.loop",
               "tnlg.training.step", "tnlg.training.setup", "tnlg.commands.pretrain", "tnlg.commands.eval",
               "tnlg.commands.generate", "tnlg.cli")
    subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], env=env, check=True, timeout=300)
    assert _log(tmp_path) == "", _log(tmp_path)
    # the hook sees what it should: a process that does use torch.compile is recorded
    subprocess.run([sys.executable, "-c", "import torch.compiler; torch.compiler.disable(print)"], env=env,
                   check=True, timeout=300)
    assert "torch/compiler/__init__.py" in _log(tmp_path), _log(tmp_path)
    (tmp_path / "dynamo.log").unlink()
    # two launched workers at TP 2 through a whole (one-iteration) run, the optimizer's steps included: none
    run_tnlg(["pretrain", "--nproc-per-node", "2", *tiny_flags(train_iters=1, tensor_model_parallel_size=2)],
             tmp_path, env=env)
    assert _log(tmp_path) == "", _log(tmp_path)
