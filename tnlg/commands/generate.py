"""``tnlg generate``: text from a checkpoint at any TP x PP x DP (the library: :mod:`tnlg.generation`).

Torch is imported only when the command runs, so ``tnlg generate --help`` answers without it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Union

from ..errors import UserError
from .inference import add_common_arguments, precheck_model, run_command, step_note

EPILOG = """\
Prompts are left-padded into batches (--micro-batch-size) with an attention mask and
per-row positions, so each continuation is what the prompt gives alone. Output: the
prompt followed by its continuation, one block per prompt; --json prints one object
{"results": [{"prompt", "text", "tokens"}, ...], ...}. A seed gives the same text at
every tensor- and pipeline-parallel size.

examples:
  tnlg generate --checkpoint gpt2/ --prompt "The Turing-NLG model" --greedy --max-new-tokens 40
  tnlg generate --checkpoint runs/ckpt --prompts-file prompts.txt --top-k 40 --temperature 0.8 --seed 7
  torchrun --nproc-per-node 2 -m tnlg generate --tp 2 --checkpoint gpt2/ --prompt "Hello" --top-p 0.9
  tnlg generate --pp 2 --checkpoint runs/ckpt --prompt "Hello" --greedy     # 2 pipeline stages, 2 processes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", metavar="F", help="a text file with one prompt per line")
    add_common_arguments(p)
    p.add_argument("--max-new-tokens", "--out-seq-length", dest="max_new_tokens", type=int, default=64,
                   help="tokens to generate per prompt (default 64; fewer where seq_length ends)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    p.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                   help="keep generating after the end-of-document token")
    p.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                   help="recompute the whole sequence for every new token (slow; for checking)")


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return list(args.prompt)
    try:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        raise UserError(f"prompts file {args.prompts_file!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read prompts file {args.prompts_file!r} as UTF-8 text: {err}.") from None
    if not prompts:
        raise UserError(f"prompts file {args.prompts_file!r} is empty; put one prompt per line.")
    return prompts


def _generate_here(args, ps, prompts: list[str]) -> dict:
    import torch.distributed as dist

    from ..generation import SamplingOptions, continuation_text, generate_tokens
    from ..generation.loading import check_tokenizer_fits, load_model, loading_note, resolve_tokenizer
    start = time.time()
    step_note("generate", ps, loading_note(args.checkpoint, ps) + " ...")
    model, spec = load_model(args.checkpoint, ps, args.tokenizer_model, args.load_adapter)
    step_note("generate", ps, f"loaded in {time.time() - start:.1f} s; generating for {len(prompts)} prompt(s)")
    tokenizer = resolve_tokenizer(args.tokenizer_model, spec, args.checkpoint)
    check_tokenizer_fits(tokenizer, model)
    # data parallelism: each TP group takes a contiguous share of the prompts
    share = -(-len(prompts) // ps.dp_size)
    first = ps.dp_rank * share
    mine = prompts[first:first + share]
    ids = [list(tokenizer.encode(p)) or [tokenizer.eod_id] for p in mine]
    t0 = time.time()
    options = SamplingOptions(args.max_new_tokens, args.greedy, args.temperature, args.top_k, args.top_p, args.seed,
                              (tokenizer.eod_id,) if args.stop_at_eod else ())
    new = generate_tokens(model, ids, options, vocab_size=tokenizer.vocab_size, batch_size=args.micro_batch_size,
                          seed_offset=first, use_cache=args.use_cache) if mine else []
    seconds = time.time() - t0
    results = [{"prompt": p, "text": continuation_text(tokenizer, i, n, args.stop_at_eod), "tokens": n}
               for p, i, n in zip(mine, ids, new)]
    if ps.dp_size > 1:  # every rank holds its group's results: take those of the first stage's TP rank 0
        gathered: list = [None] * ps.world_size
        dist.all_gather_object(gathered, results)
        results = [r for rank in range(0, ps.dp_size * ps.tp_size, ps.tp_size) for r in gathered[rank]]
    n_tokens = sum(len(r["tokens"]) for r in results)
    return {"results": results, "new_tokens": n_tokens, "generate_seconds": round(seconds, 3),
            "tokens_per_second": round(n_tokens / seconds, 2) if seconds > 0 else None,
            "tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
            "data_parallel_size": ps.dp_size, "seconds": round(time.time() - start, 3)}


def precheck_prompt_lengths(checkpoint: str, tokenizer, prompts: Union[list[str], Callable]) -> None:
    """Refuse prompts longer than ``seq_length`` before any process starts, where the checkpoint's
    metadata and tokenizer can be read without the model (the workers check again regardless). ``prompts``:
    texts, or a function of the tokenizer giving the prompts' ids."""
    from ..data.tokenizer import load_tokenizer
    from ..generation.generator import check_prompts
    from ..generation.loading import checkpoint_seq_length, hf_tokenizer_spec, is_hf_folder
    seq = checkpoint_seq_length(checkpoint)
    if tokenizer is None and is_hf_folder(checkpoint) and hf_tokenizer_spec(checkpoint):
        tokenizer = load_tokenizer(checkpoint)
    if seq is None or tokenizer is None:
        return
    ids = prompts(tokenizer) if callable(prompts) else [list(tokenizer.encode(p)) or [tokenizer.eod_id]
                                                         for p in prompts]
    check_prompts(ids, seq, tokenizer.vocab_size)


def run(args) -> int:
    def show(result: dict) -> None:
        for r in result["results"]:
            print(f"{r['prompt']}{r['text']}")
            print("-" * 40)
        pp = result["pipeline_model_parallel_size"]
        print(f"{result['new_tokens']} new tokens in {result['generate_seconds']} s "
              f"({result['tokens_per_second']} tokens/s) at TP={result['tensor_model_parallel_size']}"
              f"{f' x PP={pp}' if pp > 1 else ''}",
              file=sys.stderr)

    from ..generation import check_sampling
    check_sampling(args.max_new_tokens, args.greedy or args.temperature == 0, args.temperature, args.top_k,
                    args.top_p)
    if args.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}.")
    prompts = _read_prompts(args)
    tokenizer = precheck_model(args)
    precheck_prompt_lengths(args.checkpoint, tokenizer, prompts)
    return run_command("generate", add_arguments, args, lambda ps: _generate_here(args, ps, prompts), show)
