"""EleutherAI's lm-evaluation-harness (``lm_eval`` 0.4.x, an optional extra) on a tnlg model at any TP x PP.

:class:`TnlgLM` is an ``lm_eval.api.model.TemplateLM`` (a subclass of ``LM``): lm-eval's own code turns a
``(context, continuation)`` request into tokens (trailing spaces of the context moved to the continuation,
an empty context replaced by the end-of-document token, as for its ``hf`` backend); this class scores the
tokens, batched (:meth:`_loglikelihood_tokens`), scores documents in lm-eval's rolling windows
(:meth:`loglikelihood_rolling`) and generates greedily until a stop string (:meth:`generate_until`, through
:func:`tnlg.generation.generate_tokens`, the end-of-document token a stop too, contexts cut on the left to
leave ``max_gen_toks`` positions), as the ``hf`` backend does.

**Every rank runs the whole evaluation.** The instance tells lm-eval it is rank 0 of 1, so every rank of
the TP x PP group builds the same requests in the same order (lm-eval's seeds are fixed) and calls the
model's forward in lockstep; the figures are computed on the last pipeline stage and broadcast to every
stage (:func:`tnlg.model.inference.from_last_stage`), so every rank holds lm-eval's result. Log-likelihoods
are the log-softmax of the full vocabulary's logits (gathered over TP at the continuation's positions only)
in float64; ``is_greedy``: every continuation token is the argmax.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from ..generation.generator import continuation_text, generate_tokens
from ..generation.options import SamplingOptions
from ..generation.steps import right_padded
from ..model.inference import forward_logits, from_last_stage, model_device
from ..parallel.vocab import gather_logits

__all__ = ["TnlgLM"]


class TnlgLM(TemplateLM):
    """A tnlg model and its tokenizer as an lm-eval model (the module's docstring); ``batch_size`` sequences
    per forward, ``max_length`` the model's positions unless smaller."""

    def __init__(self, model, tokenizer, batch_size: int = 8, max_length: Optional[int] = None,
                 max_gen_toks: int = 256):
        super().__init__()
        self.model, self.tok, self.ps = model, tokenizer, model.ps
        self.batch_size = batch_size
        self.max_length = min(max_length or model.config.seq_length, model.config.seq_length)
        self.max_gen_toks = max_gen_toks
        self.vocab = model.config.vocab_size
        self.device_ = model_device(model)

    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eod_id)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "kind", type(self.tok).__name__))

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return [int(t) for t in self.tok.encode(string)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        out: list[tuple[float, bool]] = []
        for b0 in range(0, len(pairs), self.batch_size):
            out += self._score(pairs[b0:b0 + self.batch_size])
        return out

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One batch: each row's input is ``(context + continuation)[-(max_length + 1):][:-1]`` (as lm-eval's
        ``hf`` backend cuts it), right-padded; the continuation is scored at the row's last positions."""
        seqs = [(c + k)[-(self.max_length + 1):][:-1] for c, k in pairs]
        tokens = right_padded(seqs, max(map(len, seqs)), device=self.device_)
        logits = forward_logits(self.model, tokens)
        res = torch.zeros(len(pairs), 2, dtype=torch.float64, device=self.device_)
        if logits is not None:
            rows = [logits[i, len(s) - len(k):len(s)] for i, (s, (_, k)) in enumerate(zip(seqs, pairs))]
            picked = torch.cat(rows).float()
            full = gather_logits(picked, self.ps, self.vocab) if self.ps.tp_size > 1 else picked[:, :self.vocab]
            logp = torch.log_softmax(full.double(), dim=-1)
            targets = torch.tensor([t for _, k in pairs for t in k], dtype=torch.long, device=logp.device)
            chosen = logp.gather(1, targets[:, None]).squeeze(1)
            greedy = logp.argmax(-1) == targets
            at = 0
            for i, (_, k) in enumerate(pairs):
                res[i, 0] = chosen[at:at + len(k)].sum()
                res[i, 1] = float(bool(greedy[at:at + len(k)].all()))
                at += len(k)
        res = from_last_stage(res, self.ps).cpu()
        return [(float(r[0]), bool(r[1])) for r in res]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's disjoint rolling windows of ``max_length`` tokens."""
        out = []
        for (string,) in [req.args for req in requests]:
            windows = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)))
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            out.append(sum(s for s, _ in scores))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations cut at the first stop string (``until``; the end-of-document token stops too).
        Requests are batched by their generation arguments; sampling (``do_sample``) is refused."""
        args = [req.args for req in requests]
        out: list[Optional[str]] = [None] * len(args)
        groups: dict[str, list[int]] = {}
        for i, (_, kwargs) in enumerate(args):
            groups.setdefault(repr(sorted((kwargs or {}).items())), []).append(i)
        for idx in groups.values():
            kwargs = dict(args[idx[0]][1] or {})
            until, max_gen = self._generation_kwargs(kwargs)
            room = max(self.max_length - max_gen, 1)
            prompts = [(self.tok_encode(args[i][0]) or [self.eot_token_id])[-room:] for i in idx]
            options = SamplingOptions(min(max_gen, self.max_length - 1), greedy=True, stop_ids=(self.eot_token_id,))
            new = generate_tokens(self.model, prompts, options, vocab_size=self.tok.vocab_size,
                                  batch_size=self.batch_size)
            for i, p, n in zip(idx, prompts, new):
                text = continuation_text(self.tok, p, n, stop_at_eod=True)
                for stop in until:
                    text = text.split(stop)[0]
                out[i] = text
        return [str(t) for t in out]

    def _generation_kwargs(self, kwargs: dict[str, Any]) -> tuple[list[str], int]:
        if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
            raise ValueError("tnlg's lm-eval model generates greedily; the task asks for sampling (do_sample).")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = next((int(kwargs[k]) for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if k in kwargs),
                       self.max_gen_toks)
        return until, max_gen
