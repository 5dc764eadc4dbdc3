"""An optimizer piece: what a rank owns of one parameter's optimizer state, as a save writes it and a load fills it.

A piece is the range ``[lo, lo + length)`` of a parameter's flattened TP shard (the representation
Megatron-core's distributed optimizer uses for its checkpoints, "flattened-range" sharded tensors),
with 1-D views of that range of the parameter, its Adam moments and its fp32 master weights (``None``
for fp32 parameters). Views, not copies: a save writes from them and a load copies into them. The
engines hand their pieces over as dicts (``owned_pieces()``); :meth:`OptimPiece.of` types them. An engine
with a backend per gradient kind (:class:`tnlg.optim.kinds.KindsBackend`) tags each piece with its ``kind``
(``"dense"``, ``"expert"``) and whether that kind's pieces are ``sharded`` over its gradient ranks (ZeRO 1);
others leave both to the engine-wide ``pieces_sharded_over_dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

__all__ = ["OptimPiece", "STATE_KINDS"]

STATE_KINDS = ("exp_avg", "exp_avg_sq", "master")  # the optimizer states a checkpoint stores per piece


@dataclass
class OptimPiece:
    """``[lo, lo + length)`` of the flattened TP shard of parameter ``name`` and its states there."""
    name: str
    lo: int
    length: int
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    master: Optional[torch.Tensor] = None
    param: Optional[torch.Tensor] = None
    kind: str = "dense"
    sharded: Optional[bool] = None

    @classmethod
    def of(cls, piece: Mapping) -> "OptimPiece":
        """A piece from an engine's ``owned_pieces()`` entry (``name``, ``lo``, ``length``, the views; ``kind`` and
        ``sharded`` where the engine tags them)."""
        return cls(name=piece["name"], lo=int(piece["lo"]), length=int(piece["length"]),
                   exp_avg=piece.get("exp_avg"), exp_avg_sq=piece.get("exp_avg_sq"), master=piece.get("master"),
                   param=piece.get("param"), kind=piece.get("kind", "dense"), sharded=piece.get("sharded"))

    @property
    def hi(self) -> int:
        return self.lo + self.length

    def state(self, kind: str) -> torch.Tensor:
        """The 1-D state ``kind`` (one of :data:`STATE_KINDS`) of this range (an engine's piece views all of
        them; a ``ValueError`` where it does not: a bug, not input)."""
        t = getattr(self, kind)
        if t is None:
            raise ValueError(f"optimizer piece {self.name}[{self.lo}:{self.hi}] holds no {kind!r} view.")
        return t
