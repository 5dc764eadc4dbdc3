"""``--compile``: ``torch.compile`` of every transformer block, or eager with a warning saying why.

Every transformer block (:class:`tnlg.model.Block`) of the model is compiled in place
(``nn.Module.compile``): the GPT's ``nn.ModuleList`` of blocks, and a pipeline stage's
(:class:`tnlg.model.stage.StageModel`, whose blocks torch's pipeline schedules run through
the stage's chunks, forward and backward per micro batch, as eager blocks). The blocks are
identical, so one compiled graph serves them all (recompiled only for a new shape), and the model
code stays plain. The collectives inside a block (the TP all-reduces of ``g``, the
sequence-parallel gathers) are traced as they are; the pipeline's point-to-point sends and receives
are outside the blocks, in torch's schedule. Context parallelism's ring attention (P2P over the CP
group, which Dynamo does not trace) is excluded from compilation (``torch.compiler.disable``, made here, not at import): each
block's graph breaks there once and the ring runs eager, forward and backward.

Dropout: Inductor's own random numbers differ from eager's, and hidden dropout on the
replicated residual stream must draw the same mask on every TP rank, so
``torch._inductor.config.fallback_random`` is set: dropout inside compiled code draws from
the same generators, in the same order, as eager code, and a compiled run gives eager's
losses. The draws from this TP rank's generator (:class:`tnlg.parallel.random.TPRandom`:
attention dropout, and with sequence parallelism the hidden dropout) read and write the
device's RNG state, which Dynamo does not trace; inside compiled code they are custom
operators that take and return the state (``tnlg::tp_attention``, ``tnlg::tp_dropout``),
so the graph does not break there and the masks are eager's.

The toolchain is tried first on a one-line function; if compiling or running it fails (no C
compiler, an unsupported backend), the blocks stay eager and the returned reason is warned.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

__all__ = ["compile_blocks", "compiler_problem"]


def compiler_problem(device: torch.device) -> Optional[str]:
    """Why ``torch.compile`` cannot run here (the first line of the error), or ``None`` if it can."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4, device=device))
        return None
    except Exception as err:  # noqa: BLE001 - any failure of the toolchain means: stay eager
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"{type(err).__name__}: {first}"


def compile_blocks(model: nn.Module, device: torch.device) -> Optional[str]:
    """Compile every block of ``model`` in place; returns why not (and leaves it eager) if the
    compiler toolchain fails."""
    problem = compiler_problem(device)
    if problem is not None:
        return problem
    import torch._inductor.config as inductor_config
    inductor_config.fallback_random = True  # dropout draws as eager does (module docstring)
    from ..parallel.context import exclude_ring_from_compile
    exclude_ring_from_compile()
    from ..model import Block
    for m in model.modules():
        if isinstance(m, Block):
            m.compile()
    return None
