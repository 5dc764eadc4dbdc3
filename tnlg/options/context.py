"""The ``--context-parallel-size`` checks of ``tnlg pretrain``: what CP > 1 runs with, and what it refuses.

Torch-free (read at option resolution, before any process starts).
"""

from __future__ import annotations

from ..errors import UserError
from ..layout import check_context_sequence

__all__ = ["check_context_parallel_options"]


def check_context_parallel_options(o) -> None:
    """One paragraph for a CP layout this version cannot run (``o``: the run's :class:`~tnlg.options.Options`)."""
    par, cp = o.parallel, o.parallel.context_parallel_size
    if cp == 1:
        return
    check_context_sequence(cp, o.model.seq_length)
    refused = [(par.zero_impl == "deepspeed", "--zero-impl deepspeed (DeepSpeed's engine does not reduce "
                "gradients over DP x CP); use --zero-impl tnlg (ZeRO 0-3)"),
               (o.model.attention_dropout > 0, f"--attention-dropout {o.model.attention_dropout:g} (the ring "
                "attention has no dropout: CP 1 draws its masks inside the fused attention kernel over the whole "
                "[s, s] score matrix, which the ring's blocks cannot draw alike); use --attention-dropout 0")]
    for on, what in refused:
        if on:
            raise UserError(f"--context-parallel-size {cp} does not run with {what}.")
