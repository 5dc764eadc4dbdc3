"""The training loop of ``tnlg pretrain`` (TP x DP with ZeRO), as torchtitan's ``Trainer.train``.

Per iteration (global batch = micro batch x DP x accumulation steps): the learning
rate of Megatron's schedule at the optimizer steps taken, :func:`.step.train_step`,
then each component does what falls due: :class:`.metrics.Metrics` records and logs,
:class:`.validation.Validation` validates, :class:`.checkpointing.Checkpointer`
saves and stops on a signal.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Optional

import torch

from ..checkpoint.files import last_checkpoint
from ..data.sampler import MegatronPretrainingSampler
from ..data.tokenizer import load_tokenizer
from ..errors import agreed
from ..generation import generate
from ..config import GPTConfig
from ..options import Options, model_config
from ..options.components import SAMPLE_TEMPERATURE, SAMPLE_TOP_K
from ..parallel.context import context_parallel_batch
from ..parallel.random import seed_everything
from ..parallel.state import ParallelState
from .checkpointing import Checkpointer, stop_on_signals
from .loggers import build_loggers, run_name
from .metrics import Metrics
from .setup import build_datasets, build_engine, build_pipeline, init_run, precision
from .step import TrainingDiverged, next_batch, train_step
from .throughput import iteration_flops, measure_peak_tflops
from .validation import Validation

__all__ = ["Trainer", "train"]

_MEASURED = "measured: dense matmuls on every rank at once, best of 5"


def train(o: Options) -> dict:
    """Train with options ``o`` (from :func:`tnlg.commands.pretrain_args.resolve`) in this process; see :meth:`Trainer.train`."""
    return Trainer(o).train()


class Trainer:
    """One run: :meth:`train` builds everything, then runs the loop. Afterwards ``engine`` (and its
    ``model``), ``config`` and ``ps`` are the trained run's (set by :meth:`train`)."""
    engine: Any  # tnlg's Engine, or DeepSpeed's adapter
    model: torch.nn.Module
    config: GPTConfig
    ps: ParallelState

    def __init__(self, o: Options):
        self.o = o

    def train(self) -> dict:
        """Returns a summary: per-iteration ``losses`` and ``grad_norms``, the first and last validation loss,
        and, when a signal stopped the run, ``interrupted`` (``signal``, ``iteration``, ``saved``, ``forced``);
        when ``--exit-interval`` did, ``exited`` (``exit_interval``, ``iteration``, ``saved``).

        SIGINT and SIGTERM only set a flag while it runs (see :mod:`.checkpointing`).
        """
        with stop_on_signals() as stop:
            self._build(stop)
            try:
                return self._loop()
            finally:
                self.checkpointer.release()

    def _build(self, stop) -> None:
        o = self.o
        self.ps, self.accum = ps, accum = init_run(o)
        seed_everything(o.data.seed)
        self.tokenizer = load_tokenizer(o.data.tokenizer_path())
        self.config = cfg = model_config(o, self.tokenizer.vocab_size)
        self.autocast = precision(o.precision)
        self.engine = build_engine(o, cfg, ps, accum)
        if o.precision.compile:
            self._compile()
        self.model, self.schedule = self.engine.model, o.schedule.lr_schedule()
        self.pipeline = build_pipeline(o.parallel, self.model, ps, accum)
        self.train_ds, valid_ds = build_datasets(o, cfg, self.tokenizer)
        self.validation = Validation(self.model, valid_ds, o.logging, o.schedule, ps, self.autocast,
                                     self._log)  # says once why not
        # measured before loading: a resumed run continues the restored RNG streams untouched
        self.peak = o.logging.peak_tflops or measure_peak_tflops(self.autocast or torch.float32, ps.device)
        self.checkpointer = Checkpointer(o, ps.for_gradients(), model=self.model, engine=self.engine, config=cfg,
                                         tokenizer=self.tokenizer, stop=stop, log=self._log)

    def _loop(self) -> dict:
        o, ps, model, engine = self.o, self.ps, self.model, self.engine
        iteration, consumed = self.checkpointer.resume()
        metrics = self._metrics(resumed_at=iteration)
        summary: dict[str, Any] = dict(first_valid_loss=None, last_valid_loss=None, losses=[], grad_norms=[])
        if self.validation.enabled and iteration == 0:
            summary["first_valid_loss"] = metrics.validation(0, self.validation.loss())
        iters, gbs = o.schedule.train_iters, o.schedule.global_batch_size
        assert iters is not None and gbs is not None  # (ScheduleOptions requires the one; init_run sets the other)
        sampler = iter(MegatronPretrainingSampler(len(self.train_ds), consumed, o.schedule.micro_batch_size,
                                                  ps.dp_rank, ps.dp_size))
        model.train()
        try:
            stopped = self.checkpointer.before_training(iteration)  # collective: a signal during start-up
            if stopped:
                summary["interrupted"] = stopped
            while not stopped and iteration < iters:
                t0 = time.perf_counter()
                lr = self.schedule.lr(self.checkpointer.schedule_steps)
                batches = (context_parallel_batch(next_batch(self.train_ds, sampler, ps.device), ps)
                           for _ in range(self.accum))  # (this CP rank's chunks; the batch itself at CP 1)
                loss, info = train_step(model, engine, batches, lr, autocast=self.autocast, ps=ps,
                                        iteration=iteration + 1, pipeline=self.pipeline,
                                        per_token_loss=o.schedule.calculate_per_token_loss)
                iteration, consumed = iteration + 1, consumed + gbs
                metrics.iteration(iteration, consumed, loss, lr, info, time.perf_counter() - t0)
                summary["losses"].append(loss)
                summary["grad_norms"].append(info["grad_norm"])
                last = iteration == iters
                if self.validation.due(iteration, last):
                    summary["last_valid_loss"] = metrics.validation(iteration, self.validation.loss())
                stopped = self.checkpointer.after_step(iteration, consumed, last)  # collective
                if stopped:
                    summary["exited" if "exit_interval" in stopped else "interrupted"] = stopped
                    break
        except TrainingDiverged as exc:  # the DP-reduced loss: every rank stops here alike; rank 0 says it once
            raise self._diverged(exc) from None
        except KeyboardInterrupt:  # a second signal (or a Ctrl-C outside the handler's reach): stop at once
            summary["interrupted"] = self.checkpointer.forced_stop(iteration)
        try:
            metrics.close()
            if "interrupted" not in summary and "exited" not in summary:  # (the sample is the finished run's)
                self._sample()
        except KeyboardInterrupt:  # a second signal while the plot or the sample is made: skip the rest
            summary.setdefault("interrupted", self.checkpointer.forced_stop(iteration))
        return summary

    def _diverged(self, exc: TrainingDiverged) -> BaseException:
        """The divergence as every rank reports it: the last checkpoint named, marked agreed (rank 0 prints
        it, no traceback) with exit status 1; tnlg's launcher does not restart it (it would diverge again)."""
        save = self.o.checkpoint.save
        last = last_checkpoint(save)
        where = (f" The last checkpoint is iteration {last} in {save}." if last is not None
                 else " No checkpoint was saved.")
        out = TrainingDiverged(f"{exc}{where}")
        out.tnlg_status = 1
        return agreed(out)

    def _metrics(self, resumed_at: int) -> Metrics:
        """The run's log and metrics file, announced by the run's header line."""
        o, ps, cfg = self.o, self.ps, self.config
        sch, gbs, save = o.schedule, o.schedule.global_batch_size, o.checkpoint.save
        assert sch.train_iters is not None and gbs is not None  # (required; set by init_run)
        vocab = cfg.padded_vocab_size(ps.tp_size)
        # model FLOPs (MFU: what the model needs) and executed FLOPs (HFU: + what is recomputed)
        metrics = Metrics(o.logging, ps, train_iters=sch.train_iters, flops=iteration_flops(cfg, gbs, False, vocab),
                          hw_flops=iteration_flops(cfg, gbs, o.precision.recompute_granularity, vocab),
                          peak=self.peak, tokens_per_iter=gbs * cfg.seq_length,
                          path=o.logging.metrics_file or (os.path.join(save, "metrics.jsonl") if save else None),
                          resumed_at=resumed_at, loggers=build_loggers(o, resumed_at) if ps.rank == 0 else [],
                          title=run_name(o.logging, save))
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())  # (DeepSpeed ZeRO-3)
        prec, pipeline = o.precision, f"PP={ps.pp_size} ({o.parallel.pipeline_schedule}) x " if ps.pp_size > 1 else ""
        self._log(f"tnlg {'finetune' if self.o.checkpoint.finetune else 'pretrain'}: {n_params:,} parameters on this rank "
                  f"({pipeline}TP={ps.tp_size} x {f'CP={ps.cp_size} x ' if ps.cp_size > 1 else ''}DP={ps.dp_size}{f' (EP={ps.ep_size})' if ps.ep_size > 1 else ''}, ZeRO stage {o.parallel.zero_stage}, {self.accum} "
                  f"accumulation step(s), {'bf16' if prec.bf16 else 'fp16' if prec.fp16 else 'fp32'}); "
                  f"{sch.train_iters} iterations of {gbs} x {cfg.seq_length} tokens; peak {self.peak:.3f} TFLOP/s "
                  f"per rank ({'--peak-tflops' if o.logging.peak_tflops else _MEASURED}); attention kernel "
                  f"{_attention_kernel(cfg, ps, self.autocast)}")
        return metrics

    def _compile(self) -> None:
        """--compile: the blocks compiled, or eager with a warning naming why."""
        from .compile import compile_blocks
        problem = compile_blocks(self.engine.model, self.ps.device)
        if problem is not None:
            warnings.warn(f"--compile: torch.compile does not work here ({problem}); training runs eager.",
                          stacklevel=2)
        else:
            self._log("--compile: every transformer block is compiled (the first iterations compile)")

    def _log(self, msg: str) -> None:
        if self.ps.rank == 0:
            print(msg, flush=True)

    def _sample(self) -> Optional[str]:
        """The sample printed at the end (``--sample-prompt``, ``--sample-tokens``; collective over TP and,
        through a pipeline, over its stages: :mod:`tnlg.generation`)."""
        log = self.o.logging
        if not log.sample_prompt or not log.sample_tokens:
            return None
        if self.ps.cp_size > 1:
            self._log("note: no sample at the end: generation does not run with --context-parallel-size > 1.")
            return None
        self.model.eval()
        text = generate(self.model, self.tokenizer, [log.sample_prompt], max_new_tokens=log.sample_tokens,
                        greedy=False, temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, seed=self.o.data.seed)[0]
        self._log(f"sample:\n{log.sample_prompt}{text}")
        return text


def _attention_kernel(cfg, ps, autocast) -> str:
    """Which SDPA kernel the model's attention runs here (flash, efficient, cudnn or math)."""
    from ..plan.gpus import attention_kernel
    if ps.cp_size > 1:
        return f"ring over {ps.cp_size} context-parallel ranks (docs/context_parallel.md)"
    heads = cfg.num_attention_heads // ps.tp_size or 1
    return attention_kernel(ps.device, autocast or torch.float32, heads, cfg.head_dim,
                            cfg.seq_length, cfg.attention_dropout)
