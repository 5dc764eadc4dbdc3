"""``tnlg eval --task generate``: greedy predictions for prompt/completion rows, scored with ROUGE-1/2/L,
exact match and token F1 (the library: :mod:`tnlg.eval.predictions`, :mod:`tnlg.eval.scoring`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from ..errors import UserError
from .inference import step_note

EPILOG = """\
  generate  greedy generation for the rows {"prompt": ..., "completion": ...} ("response" a
            synonym; the completion may be a list of references) or {"messages": [...]} (the last
            assistant turn the reference) of the JSON Lines, Parquet or `datasets` --data: the
            prompt tokenized as `tnlg preprocess` tokenizes a document, a conversation's turns
            before the reference as fine-tuning renders and tokenizes them with the chat
            template's generation prompt; the KV cache, TP and PP as
            `tnlg generate --greedy`, stopping after the end-of-document id (not part of the
            prediction) or --max-new-tokens. Scores (fractions, means over the rows): ROUGE-1,
            ROUGE-2, ROUGE-L F-measure equal to rouge_score's RougeScorer(use_stemmer=False),
            or use_stemmer=True with --rouge-use-stemmer (nltk's Porter stemmer, reproduced),
            SQuAD v1.1 exact match and token F1 (best reference of several).
            --predictions-file F writes one JSON object per row: prompt, reference, prediction,
            tokens and the row's scores.

"""


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generate")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate per prompt at most (default 64; fewer where seq_length ends)")
    g.add_argument("--rouge-use-stemmer", action="store_true",
                   help="Porter-stem ROUGE's tokens longer than 3 characters, as rouge_score's use_stemmer=True "
                        "(default off, as rouge_score's default; PEGASUS-style summarization scores stem)")
    g.add_argument("--predictions-file", metavar="F",
                   help="write the predictions and each row's scores here (JSON Lines; replaced if it exists)")


def precheck_generate(args) -> None:
    """What --task generate can check before any process starts: its flags, the rows, the output path and
    (where the checkpoint's metadata and tokenizer can be read) each prompt's length."""
    from ..eval.completion_rows import read_completion_rows
    from ..eval.predictions import rows_prompt_ids
    from ..data.tokenizer import load_tokenizer
    from ..generation.loading import recorded_tokenizer
    from .inference import precheck_model
    from .generate import precheck_prompt_lengths
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if args.seq_length is not None:
        raise UserError("--seq-length does not apply to --task generate: a prompt and its prediction may use the "
                        "model's whole seq_length. Leave it out.")
    if len(args.input) != 1:
        raise UserError(f"--task generate scores one --data file, got {len(args.input)}: {args.input}.")
    rows = read_completion_rows(args.input[0])
    out = args.predictions_file
    if out is not None:
        folder = os.path.dirname(os.path.abspath(out))
        if os.path.isdir(out) or not os.path.isdir(folder):
            raise UserError(f"--predictions-file {out!r}: "
                            + ("that is a folder" if os.path.isdir(out) else f"its folder {folder!r} does not exist")
                            + "; give the path of a file to write in an existing folder.")
    tokenizer = precheck_model(args)
    recorded = None if tokenizer is not None else recorded_tokenizer(args.checkpoint)
    if recorded is not None:  # a tnlg checkpoint's own tokenizer (the workers load the same)
        tokenizer = load_tokenizer(recorded)
    precheck_prompt_lengths(args.checkpoint, tokenizer, lambda tok: rows_prompt_ids(tok, rows))


def _write_predictions(path: str, objects: list[dict]) -> None:
    """Write the predictions file whole or not at all (a temporary file beside it, then renamed)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".predictions-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for obj in objects:
                f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def evaluate_generate(args, ps) -> dict:
    """Generate and score on this rank (each DP group a contiguous share of the rows); rank 0 writes the
    predictions file. Every rank returns the same figures."""
    import torch.distributed as dist

    from ..eval.completion_rows import read_completion_rows
    from ..eval.predictions import greedy_predictions, rows_prompt_ids, scored_rows
    from ..generation.loading import check_tokenizer_fits, load_model, loading_note, resolve_tokenizer
    start = time.time()
    rows = read_completion_rows(args.input[0])
    step_note("eval", ps, loading_note(args.checkpoint, ps) + " ...")
    model, spec = load_model(args.checkpoint, ps, args.tokenizer_model, args.load_adapter)
    tokenizer = resolve_tokenizer(args.tokenizer_model, spec, args.checkpoint)
    check_tokenizer_fits(tokenizer, model)
    step_note("eval", ps, f"loaded in {time.time() - start:.1f} s; generating for {len(rows)} prompt(s)")
    share = -(-len(rows) // ps.dp_size)
    mine = rows[ps.dp_rank * share:(ps.dp_rank + 1) * share]
    preds = greedy_predictions(model, tokenizer, rows_prompt_ids(tokenizer, mine), args.max_new_tokens,
                               args.micro_batch_size) if mine else []
    if ps.dp_size > 1:  # every rank of a group holds its group's predictions: take those of each TP rank 0
        gathered: list = [None] * ps.world_size
        dist.all_gather_object(gathered, preds)
        preds = [p for rank in range(0, ps.dp_size * ps.tp_size, ps.tp_size) for p in gathered[rank]]
    objects, means = scored_rows(rows, preds, args.rouge_use_stemmer)
    if ps.rank == 0 and args.predictions_file:
        _write_predictions(args.predictions_file, objects)
    return {"task": "generate", **means, "cut_by_seq_length": sum(p["cut_by_seq_length"] for p in preds),
            "new_tokens": sum(len(p["tokens"]) for p in preds), "max_new_tokens": args.max_new_tokens,
            "rouge_use_stemmer": args.rouge_use_stemmer,
            "predictions_file": args.predictions_file, "checkpoint": args.checkpoint, "input": args.input[0],
            "tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
            "data_parallel_size": ps.dp_size, "context_parallel_size": ps.cp_size,
            "seconds": round(time.time() - start, 3)}


LABELS = ["rouge1", "rouge2", "rougeL", "rouge_use_stemmer", "exact_match", "f1", "count", "new_tokens",
          "max_new_tokens", "cut_by_seq_length", "predictions_file"]
