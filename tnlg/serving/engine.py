"""One decode step of the server's batch, run alike on every rank of a TP x PP group: :class:`Plan` (what
rank 0's scheduler decided, broadcast to every rank) and :class:`StepEngine` (a KV cache of ``max_batch``
rows, one CPU generator per row, the forward and the choice of the next ids).

**Continuous batching.** The cache keeps a length per row (:class:`tnlg.model.kv_cache.KVCache`), so rows of
one batch are at different positions and a row is reused by emptying it (:meth:`~KVCache.reset`). Every
step is one forward of ``[max_batch, s]`` tokens: a decoding row feeds its last token (one column), a new
row feeds the next chunk of its prompt (up to ``s`` columns, :meth:`~KVCache.feed`; **chunked prefill**),
an idle row one padding token after being emptied. ``s`` is bounded by the positions every active row has
left (a row at length ``L`` writes its padding columns at positions ``L .. L + s - 1``, which must exist,
learned position embeddings having ``seq_length`` rows): a long prompt joining a batch whose rows are near
the end of the context is fed over several steps, beside the others' decode tokens. A row's next id is
chosen once its prompt is fed; the ids of one step come from one :func:`tnlg.generation.steps.choose_next`
per group of rows sampled alike (greedy, or the same temperature / top-k / top-p), in the plan's order.

Sampling: row ``r``'s generator is seeded when its sequence starts (``Plan.seeds``) and draws once per token
it chooses, so a sequence's tokens are those :func:`tnlg.generation.generate_tokens` gives its prompt alone
with that seed, whatever else shares the batch. Collectives per step: one broadcast of the plan (a pickled
object, :func:`broadcast_plan`), the model's, the sampler's per group, and with ``Plan.logprobs`` an
all-gather of the logits over TP and a broadcast of ``[b, 1 + 2k]`` log-probabilities from the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..generation.options import SamplingOptions
from ..generation.sampling import make_generators
from ..generation.steps import choose_next, right_padded
from ..model.inference import forward_logits, from_last_stage, model_device
from ..model.kv_cache import KVCache
from ..parallel.state import ParallelState
from ..parallel.vocab import gather_logits

__all__ = ["Plan", "StepResult", "StepEngine", "broadcast_plan"]


@dataclass
class Plan:
    """One step of every rank: ``stop`` ends the loop; without ``feeds`` nothing runs (a heartbeat while
    idle, keeping the other ranks' collective within its timeout).

    ``resets``: rows emptied before the forward; ``feeds[r]``: the tokens row ``r`` feeds (every row, at
    least one); ``seeds``: rows starting a sequence, with its generator's seed; ``groups``: the rows whose
    next id is chosen, by how (``SamplingOptions``, rows); ``logprobs``: top log-probabilities per chosen
    token (``None``: none computed)."""

    stop: bool = False
    resets: list[int] = field(default_factory=list)
    feeds: list[list[int]] = field(default_factory=list)
    seeds: dict[int, int] = field(default_factory=dict)
    groups: list[tuple[SamplingOptions, list[int]]] = field(default_factory=list)
    logprobs: Optional[int] = None


@dataclass
class StepResult:
    """The chosen ids by row; with logprobs, per row ``(logprob of the id, [(id, logprob), ...] top k)``."""

    ids: dict[int, int]
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)


def broadcast_plan(plan: Optional[Plan], ps: ParallelState) -> Plan:
    """Rank 0's plan on every rank of the world (the server's ranks are one TP x PP group)."""
    box = [plan]
    if ps.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


class StepEngine:
    """The batch's KV cache and generators on this rank; :meth:`step` runs one :class:`Plan`."""

    def __init__(self, model, max_batch: int, vocab: int):
        self.model, self.ps, self.vocab = model, model.ps, vocab
        self.device = model_device(model)
        self.cache = KVCache(model, max_batch, model.config.seq_length)
        self.generators = make_generators([0] * max_batch)
        self.max_batch = max_batch

    @torch.no_grad()
    def step(self, plan: Plan) -> StepResult:
        for row, seed in plan.seeds.items():
            self.generators[row].manual_seed(int(seed))
        # every step, rows emptied or not: after a forward of rows fed different counts the cache's `end` is a
        # bound (it grew by the widest row's count), and a reset makes it the longest row's length again, so
        # the room the scheduler computed from each row's length is the room the cache checks
        self.cache.reset(plan.resets)
        counts = [len(f) for f in plan.feeds]
        width = max(counts)
        tokens = right_padded(plan.feeds, width, device=self.device)
        if width > 1:
            self.cache.feed(counts)
        logits = forward_logits(self.model, tokens, kv_cache=self.cache, last_only=True)
        logits = None if logits is None else logits[:, -1]
        ids: dict[int, int] = {}
        chosen = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        for options, rows in plan.groups:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            part = None if logits is None else logits.index_select(0, index)
            nxt = choose_next(part, self.ps, options, self.vocab, [self.generators[r] for r in rows], self.device)
            chosen.index_copy_(0, index, nxt)
            ids.update(zip(rows, nxt.tolist()))
        result = StepResult(ids)
        if plan.logprobs is not None and ids:
            result.logprobs = self._logprobs(logits, chosen, sorted(ids), plan.logprobs)
        return result

    def _logprobs(self, logits: Optional[torch.Tensor], chosen: torch.Tensor, rows: list[int], k: int) -> dict:
        """Each chosen id's log-probability under the model (``log_softmax`` of the logits, no temperature) and
        the top ``k`` ids', computed on the last stage and broadcast to every stage."""
        out = torch.empty(self.max_batch, 1 + 2 * k, dtype=torch.float64, device=self.device)
        if logits is not None:
            full = gather_logits(logits.float(), self.ps, self.vocab) if self.ps.tp_size > 1 else \
                logits.float()[..., :self.vocab]
            logp = torch.log_softmax(full.double(), dim=-1)
            out[:, 0] = logp.gather(1, chosen[:, None]).squeeze(1)
            if k:
                values, ids = logp.topk(k, dim=-1)
                out[:, 1:1 + k], out[:, 1 + k:] = values, ids.double()
        out = from_last_stage(out, self.ps).cpu()
        return {r: (float(out[r, 0]), [(int(out[r, 1 + k + j]), float(out[r, 1 + j])) for j in range(k)])
                for r in rows}
