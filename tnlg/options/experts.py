"""The mixture-of-experts checks of ``tnlg pretrain``: the layouts an MoE model runs with, and what it refuses.

Torch-free (read at option resolution, before any process starts). What runs: TP (with or without sequence
parallelism) x CP (dropless) x PP x DP at ZeRO 0-3, the experts replicated over DP (expert parallelism is the
library's, :func:`tnlg.parallel.state.init_expert_parallel`, not yet a ``tnlg pretrain`` option: docs/moe.md).
With a pipeline each stage back-propagates its own layers' auxiliary losses
(:class:`tnlg.parallel.loss.StageAuxLosses`).
"""

from __future__ import annotations

from ..errors import UserError

__all__ = ["check_expert_options"]


def check_expert_options(o) -> None:
    """One paragraph for an MoE run this version cannot run (``o``: the run's :class:`~tnlg.options.Options`)."""
    E = o.model.num_experts
    if E is None:
        return
    par = o.parallel
    refused = [(par.context_parallel_size > 1 and o.model.moe_expert_capacity_factor is not None,
                f"--context-parallel-size {par.context_parallel_size} and --moe-expert-capacity-factor "
                f"{o.model.moe_expert_capacity_factor} (the capacity is over the micro batch's tokens, which the CP "
                "ranks hold in parts); drop the factor (dropless) or use CP 1"),
               (par.zero_impl == "deepspeed", "--zero-impl deepspeed (DeepSpeed's engine does not know the expert "
                "parameters); use --zero-impl tnlg")]
    for on, what in refused:
        if on:
            raise UserError(f"--num-experts {E} (a mixture of experts) does not run with {what}.")
