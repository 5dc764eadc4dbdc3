"""How tokens are chosen and when a row stops: :class:`SamplingOptions`, checked once when built."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

from ..errors import UserError

__all__ = ["SamplingOptions", "check_sampling"]


def check_sampling(max_new_tokens, greedy, temperature, top_k, top_p) -> None:
    """A :class:`~tnlg.errors.UserError` naming the first bad value, if any."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
    if not greedy and not temperature > 0:
        raise UserError(f"temperature must be > 0 when sampling, got {temperature!r} (use greedy=True / "
                        "--greedy for argmax decoding).")
    if not isinstance(top_k, int) or top_k < 0:
        raise UserError(f"top_k must be an integer >= 0 (0 = no top-k filter), got {top_k!r}.")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {top_p!r}.")


@dataclass(frozen=True)
class SamplingOptions:
    """What :func:`tnlg.generation.generate_tokens` does at each new position.

    ``greedy`` (or ``temperature == 0``: :attr:`argmax`) takes the argmax; otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` best (0 = all) and to the nucleus of mass
    ``top_p``. Prompt ``i`` of a call draws from a CPU generator seeded with ``seed + i`` (plus the call's
    ``seed_offset``; ``seed=None``: random), so a seed gives the same tokens at every TP size and whatever
    else is in the batch. A row stops after ``max_new_tokens`` new tokens, or after it chose one of
    ``stop_ids`` (which then ends its ids). Bad values: a :class:`~tnlg.errors.UserError` when built."""

    max_new_tokens: int = 32
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.argmax, self.temperature, self.top_k, self.top_p)
        try:
            if isinstance(self.stop_ids, (str, bytes)):
                raise TypeError
            stop = tuple(operator.index(t) for t in self.stop_ids)
        except TypeError:
            raise UserError(f"stop_ids must be a sequence of token ids (integers), got {self.stop_ids!r}.") from None
        object.__setattr__(self, "stop_ids", stop)

    @property
    def argmax(self) -> bool:
        """Whether the next id is the argmax (``greedy``, or ``temperature == 0``)."""
        return self.greedy or self.temperature == 0
