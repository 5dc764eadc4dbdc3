"""Faults on one rank of a real launcher run of ``tnlg eval`` and ``tnlg generate`` (``--nproc-per-node 2
--tp 2``, gloo), each ending the whole job promptly with one message that names the failing rank.

The faults come from outside the library (``tests/fault_injection/sitecustomize.py``, imported by every
process the test starts: a stale view of the checkpoint root on rank 1, a user error on one rank after
its model loaded) or from the files on disk (a bit flip in the TP-rank-1 weights, which only rank 1
reads). For each: what the user sees, the exit status, and the time to exit, far under the
process-group timeout of 10 minutes (under 60 s).

The checkpoint root holds two iterations converted from two different ``transformers`` models (2 and
4, ``latest`` names 4); the reference figures are ``tnlg eval`` of those models' own Hugging Face folders
in one process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INJECT = os.path.join(ROOT, "tests", "fault_injection")
EXIT_WITHIN_S = 60
TEXT = "The king said to his army that the war was over. She came back to the city at night, and then the river."


def _tnlg(tmp_path, argv, **fault):
    """``tnlg argv`` with the fault variables set; ``(exit status, output, seconds)``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([INJECT, ROOT, os.environ.get("PYTHONPATH", "")]),
               **{k: str(v) for k, v in fault.items()})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tnlg", *map(str, argv)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def _json(out):
    """The one JSON object the command printed (stdout; its stderr holds progress bars)."""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0])


def _hf_model(folder, seed):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=32, n_embd=32, n_layer=2, n_head=4)).save_pretrained(folder)


def _eval_argv(checkpoint, text_file, *extra):
    return ["eval", "--task", "wikitext", "--checkpoint", checkpoint, "--input", text_file, "--overlapping-eval",
            "16", "--json", *extra]


def _argv(command, checkpoint, text_file):
    """The 2-process command line of ``command`` on ``checkpoint`` (TP 2: each rank reads its own shard)."""
    if command == "eval":
        return _eval_argv(checkpoint, text_file, "--nproc-per-node", "2", "--tp", "2")
    return ["generate", "--checkpoint", checkpoint, "--prompt", "The king said", "--max-new-tokens", "4",
            "--greedy", "--json", "--nproc-per-node", "2", "--tp", "2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A root with iterations 2 (model A) and 4 (model B, the latest), at TP 2; each model's one-process
    ``tnlg eval`` loss from its Hugging Face folder."""
    from tnlg.checkpoint import LATEST
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint

    tmp = tmp_path_factory.mktemp("inference")
    text = tmp / "text.txt"
    text.write_text(TEXT)
    root = tmp / "root"
    root.mkdir()
    losses = {}
    for name, seed, iteration in (("a", 0, 2), ("b", 1, 4)):
        hf = tmp / f"hf_{name}"
        _hf_model(hf, seed)
        src = hf_to_checkpoint(str(hf), str(tmp / f"ck_{name}"), tokenizer_model="builtin", tp_size=2)
        dst = root / f"iter_{iteration:07d}"
        shutil.copytree(src, dst)
        meta = json.loads((dst / "meta.json").read_text())
        (dst / "meta.json").write_text(json.dumps(dict(meta, iteration=iteration)))
        status, out, _ = _tnlg(tmp, _eval_argv(hf, text, "--tokenizer-model", "builtin"))
        assert status == 0, out[-3000:]
        losses[name] = _json(out)["val_loss"]
    (root / LATEST).write_text("4\n")
    assert abs(losses["a"] - losses["b"]) > 1e-3  # the two iterations are told apart by their loss
    return dict(root=root, text=text, losses=losses)


def _one_message(log, text):
    """The failure is said once, with no traceback and none of the launcher's own failure lines."""
    assert log.count(text) == 1, log[-3000:]
    assert "Traceback" not in log and "failed (exitcode" not in log and "ChildFailedError" not in log, log[-3000:]


@pytest.mark.slow
def test_rank_with_an_older_latest_evaluates_rank_0s_choice(models, tmp_path):
    """Rank 1's ``latest`` reads 2 while rank 0's reads 4: both ranks load iteration 4 (a rank loading its own
    choice would put a shard of model A beside one of model B, and the loss would match neither)."""
    status, out, took = _tnlg(tmp_path, _argv("eval", models["root"], models["text"]),
                              TNLG_TEST_STALE_VIEW="latest:1:2")
    assert status == 0 and took < EXIT_WITHIN_S * 2, (status, took, out[-3000:])
    res = _json(out)
    assert res["tensor_model_parallel_size"] == 2
    assert abs(res["val_loss"] - models["losses"]["b"]) <= 1e-5 * abs(models["losses"]["b"]), (res, models["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_rank_that_does_not_see_the_chosen_checkpoint_is_one_clear_error(models, tmp_path, command):
    status, out, took = _tnlg(tmp_path, _argv(command, models["root"], models["text"]),
                              TNLG_TEST_STALE_VIEW="hidden:1:2")
    assert status == 2 and took < EXIT_WITHIN_S, (status, took, out[-3000:])
    _one_message(out, f"tnlg {command}: error: finding the checkpoint failed on 1 of 2 ranks; rank 1: rank 1 does not "
                      "see meta.json in")
    assert "iter_0000004" in out and "the checkpoint rank 0 chose to load" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_bit_flip_in_the_shard_only_rank_1_reads_names_the_rank_and_file(models, tmp_path, command):
    root = tmp_path / "root"
    shutil.copytree(models["root"], root)
    shard = root / "iter_0000004" / "model_tp01.safetensors"
    damaged = bytearray(shard.read_bytes())
    damaged[-5] ^= 0x10  # a bit of the last tensor's data: the size stays, the SHA-256 does not
    shard.write_bytes(bytes(damaged))
    status, out, took = _tnlg(tmp_path, _argv(command, root, models["text"]))
    assert status == 2 and took < EXIT_WITHIN_S, (status, took, out[-3000:])
    _one_message(out, "failed on 1 of 2 ranks; rank 1: checkpoint file")
    assert "model_tp01.safetensors' does not match the SHA-256" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command,rank", [("eval", 1), ("generate", 0)])
def test_user_error_on_one_rank_is_printed_once_and_stops_the_other(models, tmp_path, command, rank):
    status, out, took = _tnlg(tmp_path, _argv(command, models["root"], models["text"]),
                              TNLG_TEST_USER_ERROR_AFTER_LOAD=rank)
    assert status == 2 and took < EXIT_WITHIN_S, (status, took, out[-3000:])
    _one_message(out, f"tnlg {command}: error on rank {rank} of 2: injected: the input of rank {rank} cannot be read.")
