"""A hung collective ends in one message naming it, not a traceback per rank."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tnlg.runtime.hang import FR_DIR_ENV, Hang, describe, enable_flight_recorder, is_collective_timeout, make_dump_dir, message
from tnlg.runtime.spawn import run_distributed

TIMEOUT_S = 3.0


def _grad_sync(ps, t):
    import torch.distributed as dist
    dist.all_reduce(t, group=ps.dp_group)  # rank 1 never comes


def _reported(exc):
    """What the hang report of ``exc`` says (waiting 1.5 s for the other ranks' reports), with its status."""
    from tnlg.runtime.hang import report
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = report(exc, "pretrain", wait_s=1.5)
    return status, err.getvalue()


def _hang_body(ps):
    if ps.rank == 1:  # the hung rank: it never enters the collective (and never says it is alive)
        time.sleep(TIMEOUT_S + 4)
        return None
    try:
        _grad_sync(ps, torch.ones(1))
    except RuntimeError as exc:
        assert is_collective_timeout(exc)
        return _reported(exc)
    raise AssertionError("the all_reduce with a missing rank returned")


def test_timeout_names_the_collective_group_caller_and_missing_rank():
    """A hang ends in one line naming the collective, its group, the caller and the rank that did not report
    (it used to end in rank 0's raw `RuntimeError: ... pair closure` traceback)."""
    (status, text), _ = run_distributed(_hang_body, 2, 1, timeout_s=TIMEOUT_S)
    assert status == 1 and text.count("\n") == 1 and "Traceback" not in text, text
    assert "all_reduce over the data-parallel group (ranks 0, 1)" in text
    assert "Ranks that did not report within 1.5 s: 1 " in text
    assert "(The error was: " in text and ".cc:" not in text


def _ring_hang_body(ps):
    from datetime import timedelta

    import torch.distributed as dist

    from tnlg.parallel.context import ring_attention
    group = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))  # a CP group of the two ranks
    if ps.rank == 1:  # the hung rank: it never sends its key/value block
        time.sleep(TIMEOUT_S + 4)
        return None
    q = k = v = torch.ones(1, 2, 4, 8)
    try:
        ring_attention(q, k, v, group)
    except RuntimeError as exc:
        return _reported(exc)
    raise AssertionError("the ring with a missing rank returned")


def test_a_hang_in_the_ring_attention_names_the_ring_and_the_context_parallel_group():
    """The ring's K/V exchange waits on requests of batch_isend_irecv (no torch.distributed frame): the
    report names the ring, its neighbours and the CP group, not "a collective"."""
    (status, text), _ = run_distributed(_ring_hang_body, 2, 1, timeout_s=TIMEOUT_S)
    assert status == 1 and text.count("\n") == 1 and "Traceback" not in text, text
    assert ("the ring attention's exchange of key/value blocks (sent to rank 1, received from rank 1) over the "
            "context-parallel group (ranks 0, 1), called from tnlg/parallel/context.py:") in text, text
    assert "a collective timed out" in text and ": a collective over" not in text


def test_message_has_iteration_checkpoint_and_resume(tmp_path):
    hang = Hang(error="Timed out waiting 60000ms for recv operation to complete", collective="all_reduce",
                group="the tensor-parallel group (ranks 2, 3)", caller="tnlg/parallel/mappings.py:70 (all_reduce)",
                iteration=37, options=SimpleNamespace(checkpoint=SimpleNamespace(save=str(tmp_path))), missing=[3])
    text = message(hang, "pretrain", "tnlg pretrain --save x", 1.0)
    assert ("tnlg pretrain: a collective timed out after 1 min: all_reduce over the tensor-parallel group "
            "(ranks 2, 3), called from tnlg/parallel/mappings.py:70 (all_reduce), after iteration 37") in text
    assert f"There is no checkpoint in {tmp_path} yet." in text and "Resume with: tnlg pretrain --save x" in text
    hang.options, hang.missing = SimpleNamespace(checkpoint=SimpleNamespace(save=None)), None
    text = message(hang, "pretrain", None, 0.25)
    assert "after 15 s" in text and "saved no checkpoint (no --save)" in text and "is unknown" in text


def test_not_a_timeout_is_left_alone():
    from tnlg.runtime.hang import report
    assert report(RuntimeError("CUDA out of memory"), "pretrain") is None
    assert report(ValueError("timed out"), "pretrain") is None
    assert describe(RuntimeError("x")).collective is None


def test_flight_recorder_env(tmp_path, monkeypatch):
    """On NCCL a timeout may abort the process before Python sees it: torch's flight recorder dumps instead."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if torch.__version__ >= "2.7" else \
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch 2.7 renamed them
    for k in (*names, "TORCH_NCCL_DUMP_ON_TIMEOUT", FR_DIR_ENV):
        monkeypatch.delenv(k, raising=False)
    prefix = enable_flight_recorder(str(tmp_path / "comm_trace"))
    assert prefix == str(tmp_path / "comm_trace" / "rank_")
    assert not (tmp_path / "comm_trace").exists()  # nothing on disk before the options are validated
    make_dump_dir()  # (what a worker does once it joined its group)
    assert (tmp_path / "comm_trace").is_dir()
    assert int(os.environ[names[0]]) > 0 and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ[names[1]] == prefix
    monkeypatch.setenv(names[1], "/elsewhere/rank_")  # the user's own setting wins
    assert enable_flight_recorder(str(tmp_path / "x")) == "/elsewhere/rank_"


def _workers(save: str) -> dict[int, int]:
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if save.encode() in cmd and rank and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            found[int(rank[0])] = int(pid)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the worker processes")
def test_sigstopped_worker_ends_the_job_with_one_message(tmp_path):
    """The same, as a user sees it: SIGSTOP one worker of the built-in job mid-run."""
    save = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "tnlg", "pretrain", "--train-iters", "200", "--save", save,
                             "--distributed-timeout-minutes", "0.1", "--eval-interval", "0", "--log-interval", "2",
                             "--save-interval", "2", "--no-plot", "--sample-tokens", "0", "--peak-tflops", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, stopped = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if stopped is None and re.match(r"iter\s+4/", line):
                stopped = _workers(save)[3]
                os.kill(stopped, signal.SIGSTOP)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _workers(save).values():
            os.kill(pid, signal.SIGKILL)
    out = "".join(lines)
    assert stopped is not None and proc.returncode != 0
    assert "Traceback" not in out and "pair closure" not in out, out
    # the stopped worker was continued when the agent closed it, so its SIGTERM ended it at once: the agent
    # did not sit out its 30 s grace and then SIGKILL it
    assert "Unable to shutdown process" not in out, out
    # rank 0 either times out itself or sees a peer that timed out first close its connection
    msgs = [ln for ln in lines if "tnlg pretrain: a collective " in ln]
    assert len(msgs) == 1, out
    assert "Ranks that did not report within 5 s: 3 " in msgs[0] and "The last checkpoint is iteration" in msgs[0]
    assert f"--save {save}" in msgs[0] and "after iteration" in msgs[0]


# ------------------------------------------------------------ at PP > 1 the reports name the stages
def _pipeline(ps_unused, micro_batches: int):
    """A 4-layer GPT over 2 stages (layers 0-1 and 2-3) and its 1F1B schedule, on the group's timeout."""
    from datetime import timedelta

    from tnlg.config import GPTConfig
    from tnlg.model.stage import StageModel
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.pipeline_schedule import Pipeline
    from tnlg.parallel.state import init_parallel
    ps = init_parallel(1, pipeline_parallel_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    cfg = GPTConfig(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=50)
    model = StageModel(cfg, ps, [chunk_layers(4, 2)[ps.pp_rank]])
    return ps, model, Pipeline(model, micro_batches)


class _Stalled(Exception):
    pass


def _stall_at_call(module, n: int) -> None:
    """``module``'s ``n``-th forward from now sleeps past the timeout (a stage that hangs), then raises."""
    calls, forward = [], module.forward

    def stalling(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            time.sleep(TIMEOUT_S + 4)
            raise _Stalled()
        return forward(*args, **kwargs)
    module.forward = stalling


def _stage_hang_body(ps):
    ps, model, pipeline = _pipeline(ps, 4)
    tokens = torch.randint(0, 50, (4, 2, 8), generator=torch.Generator().manual_seed(0))
    batches = [dict(tokens=t, labels=t) for t in tokens]
    pipeline.run(batches, 0.25)  # one step as usual
    if ps.pp_rank == 1:  # the last stage hangs in the forward of micro batch 1 of the next step
        _stall_at_call(model.transformer.h["2"], 2)
    try:
        pipeline.run(batches, 0.25)
    except RuntimeError as exc:
        if ps.pp_rank == 1:
            assert isinstance(exc.__cause__, _Stalled), exc  # (torch wraps a stage's error)
            return None
        return _reported(exc)
    raise AssertionError("the schedule with a stalled stage returned")


def test_a_stalled_pipeline_stage_is_named_with_the_neighbour_waiting_on_it():
    """Rank 0 (stage 0) waits for micro batch 1's gradient from stage 1, which hangs in that micro batch's
    forward; 1F1B on 2 stages: stage 0 has run the forwards of micro batches 0-2 and the backward of 0."""
    (status, text), _ = run_distributed(_stage_hang_body, 2, 1, timeout_s=TIMEOUT_S)
    assert status == 1 and text.count("\n") == 1 and "Traceback" not in text, text
    assert ("a point-to-point send/receive of the pipeline schedule over the pipeline group (ranks 0, 1), "
            "called from tnlg/parallel/pipeline_schedule.py") in text, text
    assert "Ranks that did not report within 1.5 s: 1 " in text, text
    assert ("Pipeline: rank 0 (pp 0, dp 0, tp 0: pipeline stage 0 of 2, layers 0-1) waits for the gradient of "
            "micro batch 1 from stage 1 (rank 1) (started last: the forward of micro batch 2); "
            "rank 1 (pp 1, dp 0, tp 0: pipeline stage 1 of 2, layers 2-3) did not report.") in text, text


def _stage_error_body(ps):
    from torch.distributed.distributed_c10d import _get_default_store

    from tnlg.runtime import failures
    ps, _, _ = _pipeline(ps, 2)  # (building the stages writes each rank's place)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if ps.rank == 0:  # rank 0 fails second, after rank 1 posted, and speaks for the board
            while not _get_default_store().check([f"{failures._tag()}/first"]):
                time.sleep(0.05)
        status = failures.report("pretrain", "injected: the data of rank 1 cannot be read.", 2, agreed=False)
    return status, err.getvalue()


def test_an_error_on_one_rank_names_its_pipeline_stage():
    (status0, text0), (status1, text1) = run_distributed(_stage_error_body, 2, 1, timeout_s=30)
    assert (status0, status1, text1) == (2, 2, "")
    assert text0 == ("tnlg pretrain: error on rank 1 of 2 (pp 1, dp 0, tp 0: pipeline stage 1 of 2, layers 2-3): "
                     "injected: the data of rank 1 cannot be read.\n"), text0


def test_stage_progress_names_interleaved_stages_and_every_receive_pending():
    """Interleaved: rank 3 = (pp 1, dp 0, tp 1) of PP 2 x TP 2 holds stages 1 and 3 of 4; its neighbours
    (stages 0 and 2) are on rank 1, its TP peer of pipeline rank 0."""
    from tnlg.parallel.stage_progress import StageProgress
    ps = SimpleNamespace(rank=3, pp_rank=1, pp_size=2, dp_rank=0, dp_size=1, tp_rank=1, tp_size=2)
    record = StageProgress(SimpleNamespace(ps=ps))
    record.add_stage(1, 4, range(1, 2))
    record.add_stage(3, 4, range(3, 4))
    assert record.words() == "rank 3 (pp 1, dp 0, tp 1: pipeline stages 1 (layer 1), 3 (layer 3) of 4) has no " \
                             "receive pending (started: nothing yet)"
    record.expect(1, 0, "forward")
    record.start(1, 0, "forward")  # the receive it waited for is used up
    record.expect(3, 0, "forward")
    record.expect(1, 0, "backward")
    assert record.state() == ("waits for the activations of micro batch 0 from stage 2 (rank 1) for stage 3 or "
                              "the gradient of micro batch 0 from stage 2 (rank 1) for stage 1 (started last: "
                              "the forward of micro batch 0 on stage 1)")
