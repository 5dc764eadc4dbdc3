"""``tnlg eval``: WikiText perplexity, LAMBADA accuracy, dataset loss, or generation scored with ROUGE and
exact match (:mod:`.eval_generate`) of a checkpoint (the library: :mod:`tnlg.eval`). Torch is imported only when the command runs, so ``--help`` answers without it."""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import UserError
from ..layout import add_layout_arguments, check_context_sequence, check_positive
from . import eval_generate, eval_harness
from .inference import add_common_arguments, print_table, run_command, step_note

TASKS = ("wikitext", "lambada", "loss", "text", "generate", "lm-eval")

EPILOG = """\
tasks (definitions of Megatron's zero-shot evaluation, see docs/eval.md):
  wikitext  perplexity of a raw text file with overlapping windows of seq_length tokens
            starting every --overlapping-eval tokens (each target scored once); prints
            val_loss, ppl = exp(min(20, val_loss)) and the word-level adjusted ppl that
            uses T_orig = len(raw.strip().split(" ")), counted before --detokenize (a
            word count only for WikiText's tokenisation: other files get a caveat).
  text      token-weighted perplexity of any text files (--input F1 F2 ...), each
            file scored with the same overlapping windows, its first token context
            only: val_loss = summed loss / targets of all files, ppl = exp(val_loss);
            each file's figures too. No word-level figure.
  lambada   last-word accuracy on JSON Lines {"text": ...} (LAMBADA's test file format; or
            a Parquet file / `datasets` folder with a text column),
            teacher forcing: correct when the argmax at every target position is right.
            Non-strict: the target is the text's last token. --strict: the target is the
            last word, tokenized as " " + word after the context text[:rfind(word)].strip()
            (Megatron, GPT-2 BPE). With a SentencePiece tokenizer, which adds a dummy
            prefix (" " + word would encode with an extra '▁' piece), --strict takes the
            target as the tokens covering the last word in the tokenization of the
            whole text, and the context as the tokens before them.
  loss      token-mean loss over the samples of a PREFIX.bin/.idx dataset, built like
            pretraining builds them (--split, --eval-split, --seed); or of fine-tuning rows
            (a .jsonl or .parquet file or a `datasets` folder of prompt/completion or
            messages rows): the counted tokens of every row once, as tnlg finetune's
            validation (packed or not, the same figure).
{generate}
examples:
  tnlg eval --task wikitext --checkpoint gpt2/ --input wiki.test.raw --detokenize wikitext
  tnlg eval --task lambada --strict --checkpoint gpt2/ --input lambada_test.jsonl --json
  tnlg eval --task text --checkpoint runs/gpt notes.txt essay.txt
  tnlg eval --task generate --checkpoint runs/sft --data test.jsonl --predictions-file preds.jsonl --json
  torchrun --nproc-per-node 4 -m tnlg eval --task wikitext --tp 4 --checkpoint runs/ckpt --input f.txt
  tnlg eval --task lambada --pp 2 --tp 2 --checkpoint gpt2/ --input lambada_test.jsonl   # 4 processes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG.replace("{generate}\n", eval_generate.EPILOG + eval_harness.EPILOG)
    p.add_argument("--task", required=True, choices=TASKS, help="what to measure (see below)")
    p.add_argument("--input", "--valid-data", "--data", dest="input", nargs="+", metavar="FILE",
                   help="wikitext: a raw text file; lambada: a .jsonl file (or .parquet, or a `datasets` folder); loss: a "
                        "dataset PREFIX (.bin/.idx) or fine-tuning rows (.jsonl, .parquet, a `datasets` folder); "
                        "text: one or more text files (the files may also follow the options, without --input); "
                        "generate: a .jsonl file (or .parquet, or a `datasets` folder) of prompt/completion or messages rows")
    p.add_argument("files", nargs="*", metavar="FILE", help="input file(s), the same as --input FILE")
    add_common_arguments(p)
    add_layout_arguments(p, dict(cp=1), metavar=dict(cp="C"), help=dict(
        cp="--task loss only (default 1); TP x CP x PP must divide the processes"))
    p.add_argument("--seq-length", type=int, default=None, metavar="S",
                   help="tokens per window (wikitext), per example (lambada, contexts cut on the left) or per "
                        "sample (loss); default the model's seq_length, at most its max_position_embeddings")
    g = p.add_argument_group("wikitext and text")
    g.add_argument("--overlapping-eval", type=int, default=32, metavar="STRIDE",
                   help="a new window every STRIDE tokens (default 32; = seq length: no overlap)")
    g.add_argument("--detokenize", choices=("none", "wikitext"), default="none",
                   help="apply Megatron's WikiText detokenizer before tokenizing (default none; Megatron "
                        "applies it when the file name contains 'wiki')")
    eval_generate.add_generate_arguments(p)
    eval_harness.add_harness_arguments(p)
    g = p.add_argument_group("lambada")
    g.add_argument("--strict", action="store_true",
                   help="strict last-word targets (whole last word, possibly several tokens; see below)")
    g = p.add_argument_group("loss")
    g.add_argument("--split", default="0,100,0",
                   help="document split train,valid,test as in pretraining (default 0,100,0: all documents "
                        "in 'valid')")
    g.add_argument("--eval-split", choices=("train", "valid", "test"), default="valid",
                   help="which split to evaluate (default valid)")
    g.add_argument("--seed", type=int, default=1234, help="dataset shuffling seed (default 1234, as pretraining)")
    g.add_argument("--eval-samples", type=int, default=0, metavar="N",
                   help="evaluate exactly N samples, the first N of the split's seeded order (default 0: one "
                        "pass over the split; an N beyond one pass continues into the next shuffled pass)")
    g.add_argument("--data-cache-path", default=None, help="where dataset index files are cached")
    g.add_argument("--eod-mask-loss", action="store_true", help="do not score end-of-document targets")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each document")
    g.add_argument("--reset-attention-mask", action="store_true", help="attention stops at document boundaries")


def _precheck(args) -> None:
    """Everything that can be checked before a process starts or a model loads."""
    from ..data.indexed import IndexedDataset, dataset_prefix
    from ..eval.lambada import read_lambada_texts
    from ..eval.wikitext import check_text_file
    args.input = list(args.input or []) + list(getattr(args, "files", None) or [])  # --input F, or F alone
    args.files = []  # (the launched processes get them as --input)
    if args.task == "lm-eval":
        return eval_harness.precheck_harness(args)
    if not args.input:
        raise UserError(f"--task {args.task} needs an input: --input FILE (or the file names after the options; "
                        "see tnlg eval --help).")
    for name in ("micro_batch_size", "overlapping_eval"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    check_positive(cp=args.cp)
    if args.cp > 1 and args.task != "loss":
        raise UserError(f"--context-parallel-size {args.cp}: context parallelism evaluates --task loss only (the "
                        f"window and example tasks score sequences of any length; generation does not run with "
                        f"CP); got --task {args.task}.")
    if args.cp > 1 and args.seq_length is not None:
        check_context_sequence(args.cp, args.seq_length, "each sample")
    if args.eval_samples < 0:
        raise UserError(f"--eval-samples must be >= 0 (0: one pass over the split), got {args.eval_samples}.")
    if args.seq_length is not None and args.seq_length < 1:
        raise UserError(f"--seq-length must be >= 1, got {args.seq_length}.")
    if args.task == "generate":
        return eval_generate.precheck_generate(args)
    if args.task == "text":
        for path in args.input:
            check_text_file(path)
        return _precheck_checkpoint(args)
    if len(args.input) != 1:
        raise UserError(f"--task {args.task} evaluates one --input, got {len(args.input)}: {args.input}; "
                        "--task text takes several files.")
    path = args.input[0]
    if args.task == "wikitext":
        check_text_file(path)
    elif args.task == "lambada":
        read_lambada_texts(path)
    elif is_rows_input(path):
        from ..data.sft_rows import read_rows
        read_rows(path)  # every row checked: a bad one is one paragraph naming its line
    else:
        args.input = [dataset_prefix(path)]  # X.bin, X.idx and X all mean the dataset X
        if not IndexedDataset.exists(args.input[0]):
            raise UserError(f"dataset {args.input[0]!r} not found: --task loss needs the prefix of a PREFIX.bin + "
                            "PREFIX.idx pair written by `tnlg preprocess`, or a file (or `datasets` folder) of "
                            "fine-tuning rows.")
    _precheck_checkpoint(args)


def is_rows_input(path: str) -> bool:
    """Whether ``--task loss --input PATH`` names fine-tuning rows (a file or a `datasets` folder that is no
    ``.bin/.idx`` dataset) rather than a dataset prefix."""
    import os
    from ..data.indexed import IndexedDataset, dataset_prefix
    from ..data.tables import is_table_input
    return not IndexedDataset.exists(dataset_prefix(path)) and (os.path.isfile(path) or is_table_input(path))


def _precheck_checkpoint(args) -> None:
    needs_tokenizer = args.task != "loss" or args.eod_mask_loss or args.reset_position_ids or \
        args.reset_attention_mask or is_rows_input(args.input[0])
    from .inference import precheck_model
    precheck_model(args, needs_tokenizer)


def evaluate(args, ps) -> dict:
    """Run the task of ``args`` on this rank; every rank returns the same figures."""
    from ..eval.lambada import lambada_accuracy, lambada_examples, read_lambada_texts
    from ..eval.loss import build_eval_dataset, dataset_loss
    from ..eval.text import read_text_files, text_perplexity
    from ..eval.wikitext import WORD_COUNT, check_text_file, read_wikitext, wikitext_caveat, wikitext_perplexity
    from ..generation.loading import check_tokenizer_fits, load_model, loading_note, resolve_tokenizer
    start = time.time()
    step_note("eval", ps, loading_note(args.checkpoint, ps) + " ...")
    model, spec = load_model(args.checkpoint, ps, args.tokenizer_model, args.load_adapter)
    step_note("eval", ps, f"loaded in {time.time() - start:.1f} s; evaluating --task {args.task}")
    tokenizer = None
    rows = args.task == "loss" and is_rows_input(args.input[0])
    if args.task != "loss" or rows or args.tokenizer_model or spec is not None or args.eod_mask_loss or \
            args.reset_position_ids or args.reset_attention_mask:  # a dataset's loss needs it for eod only
        tokenizer = resolve_tokenizer(args.tokenizer_model, spec, args.checkpoint)
        check_tokenizer_fits(tokenizer, model)
        if args.task == "loss" and not rows:
            from ..data.fingerprint import check_sidecar
            note = check_sidecar(args.input[0], tokenizer, "the checkpoint's tokenizer (or --tokenizer-model)")
            if note and ps.rank == 0:
                print(note, file=sys.stderr, flush=True)  # stdout may be --json
    seq = _sequence_length(args, model.config, ps)
    progress = ps.rank == 0 and not args.json and sys.stderr.isatty()
    common = dict(micro_batch_size=args.micro_batch_size, progress=progress)
    path = args.input[0]
    if args.task == "text":  # (the tokenizer is resolved above for every task but loss)
        assert tokenizer is not None
        out = text_perplexity(model, read_text_files(args.input, tokenizer), args.input,
                              stride=args.overlapping_eval, seq_length=seq, pad_id=tokenizer.eod_id, **common)
    elif args.task == "wikitext":
        assert tokenizer is not None
        tokens, n_orig = read_wikitext(path, tokenizer, args.detokenize)
        out = wikitext_perplexity(model, tokens, n_orig, stride=args.overlapping_eval, seq_length=seq,
                                  pad_id=tokenizer.eod_id, **common)
        out.update(detokenize=args.detokenize, adjusted_ppl_divides_by=f"{WORD_COUNT} - 1",
                   caveat=wikitext_caveat(path, check_text_file(path)))
    elif args.task == "lambada":
        assert tokenizer is not None
        examples, truncated = lambada_examples(read_lambada_texts(path), tokenizer, args.strict, seq, path=path)
        out = lambada_accuracy(model, examples, pad_id=tokenizer.eod_id, strict=args.strict, **common)
        out["truncated_contexts"] = truncated
    elif rows:
        out = rows_loss(model, path, tokenizer, seq, args, common)
    else:
        ds = build_eval_dataset(path, seq, split=args.split, eval_split=args.eval_split, seed=args.seed,
                                num_samples=args.eval_samples,
                                eod_id=None if tokenizer is None else tokenizer.eod_id,
                                vocab_size=model.config.vocab_size, cache_dir=args.data_cache_path,
                                eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
                                reset_attention_mask=args.reset_attention_mask)
        # the dataset holds whole passes (at least N samples); the first N of them are evaluated
        out = dataset_loss(model, ds, max_samples=args.eval_samples or None, **common)
        out.update(split=args.split, eval_split=args.eval_split, seq_length=seq)
    return {"task": args.task, **out, "checkpoint": args.checkpoint,
            "input": args.input if args.task == "text" else path,
            "tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
            "data_parallel_size": ps.dp_size, "context_parallel_size": ps.cp_size, "seconds": round(time.time() - start, 3)}


def _sequence_length(args, config, ps) -> int:
    """The evaluated length: ``--seq-length``, else the model's training length; at most its positions and, with
    context parallelism, cut into 2 x CP chunks."""
    seq = args.seq_length or config.seq_length
    if ps.cp_size > 1:
        check_context_sequence(ps.cp_size, seq, "each sample")
    if seq > config.max_position_embeddings:
        raise UserError(f"--seq-length {seq} is longer than the model's {config.max_position_embeddings} "
                        f"positions (max_position_embeddings); give --seq-length {config.max_position_embeddings} "
                        f"or less.")
    return seq


def rows_loss(model, path: str, tokenizer, seq: int, args, common: dict) -> dict:
    """The loss of fine-tuning rows ``path`` as ``tnlg finetune`` validates them: every row tokenized and
    packed as fine-tuning does (the completions counted; ``messages`` by the tokenizer's chat template), every
    sequence scored once, the sum of the counted tokens' losses over their number."""
    import torch.distributed as dist
    from ..data.sft import build_sft_datasets
    from ..eval.loss import dataset_loss
    barrier = dist.barrier if dist.is_initialized() else None
    ds, _, report = build_sft_datasets(path, None, tokenizer, seq, train_samples=0, valid_samples=0, seed=args.seed,
                                       cache_dir=args.data_cache_path, barrier=barrier)
    out = dataset_loss(model, ds, max_samples=args.eval_samples or None, **common)
    out.update(rows=report.samples, truncated=report.truncated, skipped=report.skipped, seq_length=seq)
    return out


_LABELS = {
    "wikitext": ["val_loss", "ppl", "adjusted_ppl", "total_loss", "num_tokenized_tokens", "num_original_tokens",
                 "token_ratio", "seq_length", "stride", "windows", "detokenize"],
    "lambada": ["accuracy", "correct", "num_examples", "strict", "truncated_contexts"],
    "loss": ["loss", "ppl", "num_tokens", "num_samples", "rows", "truncated", "skipped", "eval_split", "split",
             "seq_length"],
    "generate": eval_generate.LABELS,
    "text": ["val_loss", "ppl", "total_loss", "num_targets", "num_tokenized_tokens", "num_files", "seq_length",
             "stride", "windows"],
}


def _rows(result: dict) -> list[tuple[str, object]]:
    """The table's rows: the task's figures (the adjusted perplexity labelled with its divisor), each
    file's perplexity for the text task, the layout and the time."""
    from ..eval.wikitext import WORD_COUNT
    rows = []
    for k in _LABELS[result["task"]]:
        if k == "adjusted_ppl" and result.get(k) is not None:
            rows.append((f"adjusted_ppl (per word: / {result['num_original_tokens'] - 1:,} = T_orig - 1)",
                         result[k]))
        elif k == "num_original_tokens" and k in result:
            rows.append(("num_original_tokens (T_orig)", f"{result[k]} ({WORD_COUNT})"))
        elif k in result:
            rows.append((k, result[k]))
    for f in result.get("files", []) if len(result.get("files", [])) > 1 else []:
        rows.append((f"  {f['path']}", f"ppl {f['ppl']:.6g} over {f['num_targets']:,} targets"))
    rows.append(("tensor/data parallel", f"{result['tensor_model_parallel_size']} x {result['data_parallel_size']}"))
    if result.get("context_parallel_size", 1) > 1:
        rows.append(("context parallel", result["context_parallel_size"]))
    if result["pipeline_model_parallel_size"] > 1:
        rows.append(("pipeline stages", result["pipeline_model_parallel_size"]))
    rows.append(("seconds", result["seconds"]))
    return rows


def run(args) -> int:
    def show(result: dict) -> None:
        if result["task"] == "lm-eval":
            print(result["table"])
            return
        inputs = " ".join(args.input)
        print_table(f"tnlg eval --task {args.task}: {inputs}", _rows(result))
        if result.get("caveat"):
            print(f"note: {result['caveat']}")

    _precheck(args)
    work = {"generate": eval_generate.evaluate_generate, "lm-eval": eval_harness.evaluate_harness}.get(args.task,
                                                                                                    evaluate)
    return run_command("eval", add_arguments, args, lambda ps: work(args, ps), show)
