"""A ``tnlg`` command run in this process and relaunched on 2 processes, as the tests of the launching commands
(eval, generate) compare them."""

from __future__ import annotations

import json


def json_here_and_on_two_processes(capfd, argv: list[str]) -> tuple[dict, dict]:
    """The JSON object ``tnlg argv`` prints in this process, and the one it prints relaunched with
    ``--nproc-per-node 2 --tp 2`` (rank 0 alone prints, one line), which ran at TP 2."""
    from tnlg.cli import main
    assert main(argv) == 0
    one = json.loads(capfd.readouterr().out)
    assert main(argv + ["--nproc-per-node", "2", "--tp", "2"]) == 0
    out = capfd.readouterr().out
    assert out.count("\n") == 1
    two = json.loads(out)
    assert two["tensor_model_parallel_size"] == 2
    return one, two
