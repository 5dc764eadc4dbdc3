"""The mixture-of-experts checks of ``tnlg pretrain``: the layouts an MoE model runs with, and what it refuses.

Torch-free (read at option resolution, before any process starts). What runs: TP (with or without sequence
parallelism) x CP (dropless) x PP x DP at ZeRO 0-3, and expert parallelism ``--expert-model-parallel-size EP``
(EP carved from DP x CP, :func:`tnlg.parallel.state.init_expert_parallel`) at ZeRO 0-3 (at 2 and 3 with an
expert-DP group of two ranks or more); checkpoints of any of them (docs/moe.md). With a pipeline each stage
back-propagates its own layers' auxiliary losses (:class:`tnlg.parallel.loss.StageAuxLosses`). That EP divides
DP x CP is checked with the layout, once the world is known (:func:`tnlg.layout.check_expert_parallel_size`, from
:meth:`tnlg.options.Options.check_layout`).
"""

from __future__ import annotations

from ..config import divisors
from ..errors import UserError
from ..layout import FLAGS

__all__ = ["check_expert_options", "check_expert_sharding"]


def check_expert_options(o) -> None:
    """One paragraph for an MoE run this version cannot run (``o``: the run's :class:`~tnlg.options.Options`)."""
    E, par = o.model.num_experts, o.parallel
    ep, flag = par.expert_model_parallel_size, FLAGS["ep"][0]
    if E is None:
        if ep > 1:
            raise UserError(f"{flag} {ep} splits the experts of a mixture of experts over {ep} ranks, but the model "
                            "has none (--num-experts is not set). Give --num-experts E (a multiple of the EP size), or "
                            f"drop {flag} (1: every rank holds the whole model).")
        return
    etp, tp = par.expert_tensor_parallel_size, par.tensor_model_parallel_size
    if etp is not None and etp != tp:
        raise UserError(f"--num-experts {E} with --expert-tensor-parallel-size {etp}: tnlg splits the experts' weights over TP as the dense "
                        f"MLP's (megatron-core's default, expert TP = TP), so the experts' TP size is --tensor-model-"
                        f"parallel-size {tp}; a separate expert TP size (megatron-core's expert-TP x EP folding) is not "
                        f"built. Drop --expert-tensor-parallel-size or give {tp}.")
    if E % ep:
        raise UserError(f"{flag} {ep} does not divide --num-experts {E}: every expert-parallel rank holds the same "
                        f"number of experts. Valid expert-parallel sizes for {E} experts: {divisors(E)} (each also "
                        "dividing DP x CP).")
    refused = [(par.context_parallel_size > 1 and o.model.moe_expert_capacity_factor is not None,
                f"--context-parallel-size {par.context_parallel_size} and --moe-expert-capacity-factor "
                f"{o.model.moe_expert_capacity_factor} (the capacity is over the micro batch's tokens, which the CP "
                "ranks hold in parts); drop the factor (dropless) or use CP 1"),
               (par.zero_impl == "deepspeed", "--zero-impl deepspeed (DeepSpeed's engine does not know the expert "
                "parameters); use --zero-impl tnlg"),
]
    for on, what in refused:
        if on:
            raise UserError(f"--num-experts {E} (a mixture of experts) does not run with {what}.")


def check_expert_sharding(o, dp: int, cp: int) -> None:
    """ZeRO 2/3 (FSDP2) shards the experts over the expert-data-parallel ranks (DP x CP / EP): one paragraph where
    there is one (EP = DP x CP), which has nothing to shard (``o``: the run's options; its layout's DP and CP)."""
    par = o.parallel
    ep = par.expert_model_parallel_size
    if ep > 1 and par.zero_stage >= 2 and ep == dp * cp:
        raise UserError(f"{FLAGS['ep'][0]} {ep} with --zero-stage {par.zero_stage}: EP {ep} = DP x CP leaves each "
                        "expert on one rank (an expert-data-parallel group of one), so FSDP2 has nothing to shard of "
                        "the experts. Use --zero-stage 1 (the same memory for the experts, the dense parameters' "
                        f"optimizer states partitioned), or an EP below {dp * cp} (a divisor of DP x CP).")
