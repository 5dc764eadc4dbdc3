"""``tnlg eval --task lm-eval``: EleutherAI's lm-evaluation-harness (``lm_eval`` 0.4.x, the optional extra
``harness``) on a checkpoint at any TP x PP (the library: :mod:`tnlg.eval.harness`). lm-eval prints its own
table; ``--output-path`` gets its JSON."""

from __future__ import annotations

import argparse
import json
import os
import time

from ..errors import UserError
from .inference import step_note

EPILOG = """\
  lm-eval   EleutherAI's lm-evaluation-harness (pip install -e ".[harness]"): --tasks NAME ...
            (lm-eval's task names or groups, or tasks of --include-path DIR: YAML files whose data
            may be local JSON Lines, `dataset_path: json` with `dataset_kwargs: {data_files: ...}`,
            so they run offline), --num-fewshot N, --limit L (documents per task), batched by
            --micro-batch-size, every rank of the TP x PP group in lockstep. Prints lm-eval's table;
            --output-path F writes its results as JSON. Generation is greedy (docs/eval.md).

"""


def add_harness_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("lm-eval")
    g.add_argument("--tasks", nargs="+", metavar="NAME", help="lm-eval task or group names")
    g.add_argument("--include-path", metavar="DIR", help="a folder of task YAML files (lm-eval's --include_path)")
    g.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="few-shot examples (default: the task's)")
    g.add_argument("--limit", type=float, default=None, metavar="L",
                   help="documents per task (a fraction when < 1; default all)")
    g.add_argument("--output-path", metavar="F", help="write lm-eval's results as JSON here")


def precheck_harness(args) -> None:
    """Flags, lm-eval itself and the task names, before any process starts."""
    if args.input:
        raise UserError(f"--task lm-eval reads its data through lm-eval's tasks (--tasks, --include-path), not "
                        f"--input; got {args.input}.")
    args.input = None  # (the launched processes' command line then has no empty --input)
    if not args.tasks:
        raise UserError("--task lm-eval needs --tasks NAME ... (lm-eval's task names, or those of --include-path DIR).")
    if args.include_path and not os.path.isdir(args.include_path):
        raise UserError(f"--include-path {args.include_path!r} is not a folder of task YAML files.")
    if args.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}.")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {args.num_fewshot}.")
    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be > 0, got {args.limit}.")
    _task_manager(args)
    from .inference import precheck_model
    precheck_model(args)


def _task_manager(args):
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError('--task lm-eval needs lm-evaluation-harness 0.4.x, an optional extra: pip install -e '
                        '".[harness]" (or pip install "lm-eval>=0.4,<0.5").') from None
    manager = TaskManager(include_path=args.include_path, verbosity="ERROR")
    unknown = [t for t in args.tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {args.include_path}" if args.include_path else " (pass --include-path DIR for your own)"
        raise UserError(f"lm-eval knows no task {', '.join(map(repr, unknown))}{where}; `lm-eval ls tasks` lists "
                        "its tasks.")
    return manager


def evaluate_harness(args, ps) -> dict:
    """lm-eval's ``simple_evaluate`` with a :class:`~tnlg.eval.harness.TnlgLM` on every rank, in lockstep; lm-eval
    returns its result on rank 0 alone, which writes ``--output-path``."""
    import lm_eval
    from lm_eval.utils import make_table

    from ..eval.harness import TnlgLM
    from ..generation.loading import check_tokenizer_fits, load_model, loading_note, resolve_tokenizer
    start = time.time()
    step_note("eval", ps, loading_note(args.checkpoint, ps) + " ...")
    model, spec = load_model(args.checkpoint, ps, args.tokenizer_model, args.load_adapter)
    tokenizer = resolve_tokenizer(args.tokenizer_model, spec, args.checkpoint)
    check_tokenizer_fits(tokenizer, model)
    lm = TnlgLM(model, tokenizer, batch_size=args.micro_batch_size, max_length=args.seq_length)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    out = lm_eval.simple_evaluate(model=lm, tasks=list(args.tasks), num_fewshot=args.num_fewshot, limit=limit,
                                  task_manager=_task_manager(args), log_samples=False, bootstrap_iters=0)
    if out is None:  # lm-eval builds its result on the launcher's LOCAL_RANK 0 only (rank 0 here), which prints it
        return {"task": "lm-eval", "results": None}
    results = json.loads(json.dumps({k: out[k] for k in ("results", "versions", "n-shot", "configs")
                                     if k in out}, default=str))
    if ps.rank == 0 and args.output_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_path)), exist_ok=True)
        with open(args.output_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return {"task": "lm-eval", "results": results["results"], "table": make_table(out),
            "tasks": list(args.tasks), "num_fewshot": args.num_fewshot, "limit": args.limit,
            "output_path": args.output_path, "checkpoint": args.checkpoint,
            "tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
            "seconds": round(time.time() - start, 3)}
