"""Model-state bytes per rank of a LoRA fine-tuning run: a frozen base and trainable adapters.

The base is frozen: its parameters alone, ``p`` bytes each (2 in 16-bit, 4 in fp32), no gradient, no optimizer
state; ZeRO 3 shards them over DP as any parameter (``p Psi_base / Nd``), stages 0-2 keep them whole. The
adapters are trained as any parameters: :func:`.memory.model_state_bytes` of ``Psi_lora`` (tnlg's engine). Both
counts are read off the model built on the meta device at each TP rank, its adapters added as ``tnlg finetune``
adds them (:func:`tnlg.interop.peft.add_lora`), so uneven splits and replicated factors count as they are
allocated; the largest rank is reported.

Per column-parallel layer and part the adapters hold ``R in`` (``A``, replicated) + ``R out_r`` (``B``); per
row-parallel layer ``R in_r`` + ``R out``: e.g. Llama-3-8B at TP 2 with rank 16 on ``q_proj, v_proj`` holds
``32 (16 * 4096 + 16 * 2048 + 16 * 4096 + 16 * 512) = 5,505,024`` adapter parameters per rank beside
``4,015,263,744`` frozen ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..config import GPTConfig
from .memory import PRECISIONS, model_state_bytes

__all__ = ["lora_model_states"]


def _counts(cfg: GPTConfig, tp: int, tp_rank: int, rank: int, targets: Optional[Sequence[str]]) -> tuple[int, int]:
    """``(frozen, adapter)`` parameters of TP rank ``tp_rank``."""
    from ..adapters.lora import LoraSettings
    from ..interop.peft import add_lora
    from ..model import GPT
    from ..parallel.state import ParallelState
    model = GPT(cfg, ParallelState.for_virtual_rank(tp, tp_rank), device="meta")
    add_lora(model, LoraSettings(rank), targets)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return frozen, sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_model_states(cfg: GPTConfig, tp: int, dp: int, zero_stage: int, precision: str, rank: int,
                      targets: Optional[Sequence[str]] = None) -> dict:
    """The largest TP rank's model-state bytes with a frozen base and rank-``rank`` adapters on ``targets``
    (PEFT's names; default PEFT's for the family), beside full fine-tuning's of the same rank."""
    p_bytes = PRECISIONS[precision][0]
    best: Optional[dict] = None
    for r in range(tp):
        frozen, adapters = _counts(cfg, tp, r, rank, targets)
        base = p_bytes * (frozen / dp if zero_stage >= 3 else frozen)
        states = model_state_bytes(adapters, dp, zero_stage, precision, engine=True)
        total = round(base + states["total"])
        if best is None or total > best["total"]:
            full = model_state_bytes(frozen, dp, zero_stage, precision, engine=True)["total"]
            best = dict(tp_rank=r, rank=rank, frozen_params=frozen, adapter_params=adapters, base_bytes=round(base),
                        adapter_bytes=states, total=total, full_finetuning_total=full, ratio=total / full)
    assert best is not None
    return best
