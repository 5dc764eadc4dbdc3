"""``tnlg serve``: an OpenAI-compatible HTTP server over a checkpoint at any TP x PP (the library:
:mod:`tnlg.serving`; docs/serve.md).

Torch, FastAPI and uvicorn are imported only when the command runs, so ``tnlg serve --help`` answers without them.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import UserError
from ..layout import add_layout_arguments
from ..runtime.launch import under_launcher
from .inference import add_model_arguments, run_command, step_note

EPILOG = """\
Rank 0 listens on --host:--port; every rank runs each decode step in lockstep. Endpoints as OpenAI's:
POST /v1/completions, POST /v1/chat/completions (the chat template fine-tuning uses), GET /v1/models,
GET /health, and a chat page at /. Requests are batched per step (continuous batching: a request joins
and leaves the batch between any two steps); past --max-queue waiting requests the answer is 429.

examples:
  tnlg serve --checkpoint gpt2/ --tokenizer-model builtin
  tnlg serve --checkpoint runs/ckpt --tp 2 --port 8080 --max-batch 16
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    add_model_arguments(p)
    add_layout_arguments(p, dict(tp=1, pp=1), metavar=dict(tp="N", pp="P"), help=dict(
        tp="default 1; one process per TP x PP rank", pp="default 1; the layers split over P stages"))
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; another needs --allow-remote)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one, printed)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host other than loopback (the server has no authentication and no TLS)")
    p.add_argument("--max-batch", type=int, default=8, metavar="B",
                   help="sequences generated together, each a row of the KV cache (default 8)")
    p.add_argument("--max-queue", type=int, default=64, metavar="Q",
                   help="requests waiting for rows before new ones get 429 (default 64)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: the checkpoint folder's name)")
    p.set_defaults(nproc_per_node=None, nnodes=1, rdzv_endpoint=None, json=False)


def _check(args) -> None:
    from ..serving.server import bind, check_host
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}.")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}.")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}.")
    check_host(args.host, args.allow_remote)
    if not under_launcher() and args.port:  # the port checked before any process starts (rank 0 binds it)
        bind(args.host, args.port).close()


def _name(args) -> str:
    import os
    return args.served_model_name or os.path.basename(os.path.normpath(args.checkpoint)) or "tnlg"


def _serve_here(args, ps) -> dict:
    from ..generation.loading import check_tokenizer_fits, load_model, loading_note, resolve_tokenizer
    from ..serving.server import ServeOptions, serve_loop
    start = time.time()
    step_note("serve", ps, loading_note(args.checkpoint, ps) + " ...")
    model, spec = load_model(args.checkpoint, ps, args.tokenizer_model, args.load_adapter)
    tokenizer = resolve_tokenizer(args.tokenizer_model, spec, args.checkpoint)
    check_tokenizer_fits(tokenizer, model)
    step_note("serve", ps, f"loaded in {time.time() - start:.1f} s")
    options = ServeOptions(args.host, args.port, args.max_batch, args.max_queue, _name(args))
    return serve_loop(model, tokenizer, ps, options)


def run(args) -> int:
    def show(result: dict) -> None:
        why = f" ({result['signal']})" if result.get("signal") else ""
        print(f"tnlg serve: stopped{why}; served {result.get('served', 0)} requests, "
              f"{result.get('generated_tokens', 0)} tokens.", file=sys.stderr, flush=True)

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError('tnlg serve needs FastAPI and uvicorn, an optional extra: pip install -e ".[serve]" '
                        '(or pip install fastapi uvicorn).') from None
    from .inference import precheck_model
    _check(args)
    precheck_model(args)
    return run_command("serve", add_arguments, args, lambda ps: _serve_here(args, ps), show)
