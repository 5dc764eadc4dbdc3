"""Data subcommands: ``tnlg train-tokenizer``, ``tnlg preprocess``, ``tnlg data prepare|info``.

All three are registered in ``tnlg/cli.py`` with this module; ``add_arguments``
tells them apart by the parser's ``prog`` ("tnlg preprocess") and ``run`` by
``args.command``.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..data.corpus import prepare
from ..data.gpt2_bpe import train_gpt2_bpe
from ..data.indexed import IndexedDataset
from ..data.preprocess import preprocess
from ..data.tokenizer import load_tokenizer, space_piece_share, train_sentencepiece
from ..errors import UserError

__all__ = ["add_arguments", "run"]

# train-tokenizer notes a tokenizer that spends more than this share of its tokens on the single-space piece
SPACE_SHARE_NOTE = 0.2

_TRAIN_TOKENIZER_HELP = """\
Train a SentencePiece tokenizer, or a GPT-2-style byte-level BPE, on text files.

Inputs are read like `tnlg preprocess` reads them (.txt: one document per file;
.jsonl: one JSON object per line, text under --json-keys; .parquet files and
`datasets` save_to_disk folders: one document per row, text in the --json-keys
columns). The SentencePiece defaults give a model that round-trips text exactly,
decode(encode(text)) == text:
  --model-type bpe, normalization_rule_name=identity (no NFKC folding),
  remove_extra_whitespaces=False (runs of spaces are kept), byte_fallback=True
  (characters outside the vocabulary become UTF-8 byte pieces, never <unk>).
  (The one exception: U+2581 '▁', SentencePiece's space marker, decodes as a space.)
Special ids: unk=0, bos=1, eos=2 (the end-of-document token), no pad.
Writes PREFIX.model and PREFIX.vocab (temporary names, then renamed).

--model-type gpt2-bpe trains GPT-2's byte-level BPE with the `tokenizers` library
(GPT-2's pre-tokenizer regex, 256 byte symbols, no prefix space, <|endoftext|> as
the last id) and writes vocab.json + merges.txt into the folder --output-prefix,
which `tnlg preprocess --tokenizer-model FOLDER` and Hugging Face's
GPT2TokenizerFast.from_pretrained(FOLDER) both read.

examples:
  tnlg train-tokenizer --input corpus/*.txt --vocab-size 4096 --output-prefix tok/bpe4096
  tnlg train-tokenizer --input data.parquet --json-keys content --model-type gpt2-bpe \\
      --vocab-size 8192 --output-prefix tok/gpt2-8k
"""

_PREPROCESS_HELP = """\
Tokenize raw text into Megatron's mmap indexed format (.bin/.idx).

Inputs: JSON Lines (.jsonl/.json/.ndjson, one document per line, text under
--json-keys, default 'text'), plain text (.txt, the whole file is one
document, read byte-exact), Parquet (.parquet) and folders written by
`datasets` save_to_disk (one document per row, the text in the --json-keys
columns, read a row group at a time; needs pyarrow). All inputs are checked
before anything is written: an input with no documents, a malformed JSON line
(file:line), a table without the named column are errors.
Output per key: PREFIX_<key>_document.bin/.idx, one sequence per document,
uint16 tokens when the vocabulary has fewer than 65500 entries, else int32;
byte-identical to Megatron's tools/preprocess_data.py for the same tokens.
Files are written under temporary names and renamed only on success.

example: tnlg preprocess --input data.jsonl --output-prefix data/my-corpus \\
             --tokenizer-model tok/bpe4096.model --append-eod --workers 2
"""

_DATA_HELP = """\
Built-in corpus and indexed-dataset tools.

  prepare  tokenize the built-in Shakespeare + Milton corpus into a cache folder
           (default $TNLG_CACHE or ~/.cache/tnlg); reuses valid files.
  info     check a .bin/.idx pair and print its header, counts and a preview.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of the subcommand this parser is for (read from ``parser.prog``)."""
    name = parser.prog.split()[-1]
    adders = {"train-tokenizer": _add_train_tokenizer, "preprocess": _add_preprocess, "data": _add_data}
    if name not in adders:
        raise ValueError(f"tnlg.commands.data has no subcommand {name!r}; it provides {sorted(adders)}")
    adders[name](parser)


def run(args: argparse.Namespace) -> int:
    runners = {"train-tokenizer": _run_train_tokenizer, "preprocess": _run_preprocess, "data": _run_data}
    return runners[args.command](args)


# ----------------------------------------------------------------- train-tokenizer

def _add_train_tokenizer(p: argparse.ArgumentParser) -> None:
    p.description = _TRAIN_TOKENIZER_HELP
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help=".txt, .jsonl or .parquet files, or datasets save_to_disk folders")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="vocabulary size (>= 260, gpt2-bpe >= 258; under 65500 keeps .bin files at uint16)")
    p.add_argument("--output-prefix", required=True, metavar="P",
                   help="writes P.model and P.vocab (gpt2-bpe: the folder P with vocab.json + merges.txt)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="text keys of .jsonl inputs, text columns of Parquet / datasets inputs")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word", "gpt2-bpe"],
                   help="SentencePiece model type (default: bpe), or gpt2-bpe: GPT-2's byte-level BPE")
    p.add_argument("--num-threads", type=int, default=1,
                   help="trainer threads (default 1: the result does not depend on the machine)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other SentencePiece trainer option, e.g. --option character_coverage=1.0 "
                        "(may override the round-trip defaults)")


def _parse_options(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--option {item!r} is not KEY=VALUE (e.g. character_coverage=1.0).")
        k, v = item.split("=", 1)
        low = v.lower()
        out[k.strip()] = True if low == "true" else False if low == "false" else v
    return out


def _run_train_tokenizer(args) -> int:
    if args.model_type == "gpt2-bpe":
        if args.option:
            raise UserError(f"--option {args.option[0]!r} is a SentencePiece trainer option; --model-type gpt2-bpe "
                            "takes none (its settings are GPT-2's).")
        folder = train_gpt2_bpe(args.input, args.vocab_size, args.output_prefix, json_keys=args.json_keys)
        tok = load_tokenizer(folder)
        print(f"wrote {folder}/vocab.json + merges.txt (vocab {tok.vocab_size}, eod id {tok.eod_id})")
        return 0
    options = _parse_options(args.option)
    options.setdefault("model_type", args.model_type)
    options.setdefault("minloglevel", 1)
    path = train_sentencepiece(args.input, args.vocab_size, args.output_prefix, json_keys=args.json_keys,
                               num_threads=args.num_threads, **options)
    tok = load_tokenizer(path)
    print(f"wrote {path} (vocab {tok.vocab_size}, eod id {tok.eod_id})")
    if "allow_whitespace_only_pieces" not in options:
        share = space_piece_share(path, args.input, args.json_keys)
        if share > SPACE_SHARE_NOTE:
            print(f"note: {share:.0%} of this tokenizer's tokens on the input are the single-space piece (indented "
                  f"code or runs of spaces), so a model trained on it spends them on spaces. Training again with "
                  f"--option allow_whitespace_only_pieces=true learns pieces of several spaces (on Python code: "
                  f"35% fewer tokens, still round-tripping); see docs/data.md.", file=sys.stderr)
    return 0


# ----------------------------------------------------------------- preprocess

def _add_preprocess(p: argparse.ArgumentParser) -> None:
    p.description = _PREPROCESS_HELP
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help=".jsonl, .txt or .parquet files, or datasets save_to_disk folders")
    p.add_argument("--output-prefix", required=True, metavar="P",
                   help="output prefix; files are P_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-model", metavar="M",
                   help="SentencePiece .model file, a folder with GPT-2 vocab.json + merges.txt, or 'builtin'")
    p.add_argument("--vocab-file", metavar="F", help="GPT-2 BPE vocab.json (with --merge-file)")
    p.add_argument("--merge-file", metavar="F", help="GPT-2 BPE merges.txt (with --vocab-file)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="keys to extract from each JSON line, or the text columns of Parquet / datasets inputs "
                        "(default: text); one output per key")
    p.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document (Megatron's --append-eod)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="encoding processes (default 1); document order is kept")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_preprocess(args) -> int:
    if args.vocab_file or args.merge_file:
        if not (args.vocab_file and args.merge_file) or args.tokenizer_model:
            raise UserError("give either --tokenizer-model, or both --vocab-file and --merge-file (GPT-2 BPE).")
        tokenizer = {"kind": "gpt2bpe", "vocab_file": args.vocab_file, "merges_file": args.merge_file}
    elif args.tokenizer_model:
        tokenizer = args.tokenizer_model
    else:
        raise UserError("no tokenizer: pass --tokenizer-model M.model (or 'builtin'), or --vocab-file and "
                        "--merge-file for GPT-2 BPE.")
    s = preprocess(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                   append_eod=args.append_eod, workers=args.workers, progress=not args.quiet)
    for key, prefix in s["outputs"].items():
        print(f"{key}: {prefix}.bin/.idx (train with --data-path {prefix})")
    note = f", {s['empty_documents_skipped']} empty documents skipped" if s["empty_documents_skipped"] else ""
    print(f"{s['documents']} documents, {s['tokens']} tokens ({s['dtype']}) in {s['seconds']:.1f} s "
          f"= {s['tokens_per_s'] / 1e3:,.0f}k tokens/s with {s['workers']} worker(s){note}")
    return 0


# ----------------------------------------------------------------- data

def _add_data(p: argparse.ArgumentParser) -> None:
    p.description = _DATA_HELP
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    prep = sub.add_parser("prepare", help="tokenize the built-in corpus into a cache folder",
                          description="Tokenize the built-in Shakespeare + Milton corpus (with its shipped "
                                      "SentencePiece model) into ready .bin/.idx files; prints the data prefix "
                                      "and tokenizer path. Reuses valid files; safe to run concurrently.")
    prep.add_argument("--cache-dir", metavar="D", help="cache folder (default: $TNLG_CACHE or ~/.cache/tnlg)")
    prep.add_argument("--workers", type=int, default=2, help="encoding processes (default 2)")
    prep.add_argument("--force", action="store_true", help="rebuild even when valid files exist")
    prep.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    info = sub.add_parser("info", help="check a .bin/.idx pair and print its summary",
                          description="Open PREFIX.bin/.idx with all checks and print the header and counts; "
                                      "with --tokenizer-model also decode the start of the first document.")
    info.add_argument("prefix", help="dataset prefix (without .bin/.idx)")
    info.add_argument("--tokenizer-model", metavar="M", help="tokenizer to decode a preview with")


def _run_data(args) -> int:
    if args.data_command == "prepare":
        prefix, tok = prepare(cache_dir=args.cache_dir, workers=args.workers, force=args.force, progress=True)
        if args.json:
            print(json.dumps({"data_prefix": prefix, "tokenizer_model": tok}))
        else:
            print(f"data prefix:     {prefix}\ntokenizer model: {tok}\n"
                  f"train with:      --data-path {prefix} --tokenizer-model {tok}")
        return 0
    if args.data_command == "info":
        ds = IndexedDataset(args.prefix)
        lengths = ds.sequence_lengths
        print(f"{ds.path_prefix}: dtype {ds.dtype.name} (code {ds.dtype_code}), {len(ds)} sequences, "
              f"{ds.num_documents} documents, {ds.num_tokens} tokens; sequence length min/mean/max "
              f"{int(lengths.min()) if len(ds) else 0}/{float(lengths.mean()) if len(ds) else 0:.1f}/"
              f"{int(lengths.max()) if len(ds) else 0}")
        if args.tokenizer_model and ds.num_documents:
            tokenizer = load_tokenizer(args.tokenizer_model)
            print(repr(tokenizer.decode(ds.document(0)[:64].tolist())))
        return 0
    print("tnlg data: choose an action: prepare, info (see tnlg data --help)", file=sys.stderr)
    return 2
