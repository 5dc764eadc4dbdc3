"""Hugging Face interop: ``GPT2LMHeadModel`` <-> tnlg full state dicts, and exported folders.

Differences handled here: GPT-2 stores linear weights as ``Conv1D`` (``[in, out]``,
transposed) and its fused QKV as ``[q | k | v]`` over all heads, where tnlg lays
QKV out per head (``[head][q, k, v][head_dim]``) so a contiguous TP split gives
whole heads. No network access: give a model object or a local folder.

An exported folder (:func:`write_hf_folder`, behind :func:`to_hf` and ``tnlg convert
--to hf``) is written under a temporary name beside the destination and renamed into
place; a destination that exists and is not empty is refused, never deleted. With a
tokenizer it also carries ``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json`` (:func:`hf_tokenizer_files`), which encode every text to the
ids tnlg's tokenizer gives, with the end-of-document token as ``bos``/``eos`` (docs/hf.md).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from .config import GPTConfig
from .data.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer, load_tokenizer
from .errors import UserError
from .io import fsync_dir, give_umask_mode, temporary_name
from .parallel.pipeline_inference import inference_model
from .parallel.sharding import full_state_dict, load_full_state_dict
from .parallel.state import ParallelState

__all__ = ["from_hf", "to_hf", "config_from_hf", "hf_config_from", "hf_to_tnlg_state_dict", "tnlg_to_hf_state_dict",
           "build_hf_model", "write_hf_folder", "hf_tokenizer", "hf_tokenizer_files"]

_TANH_GELU, _EXACT_GELU = ("gelu_new", "gelu_pytorch_tanh"), ("gelu",)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    act = getattr(hf_config, "activation_function", "gelu_new")
    if act not in _TANH_GELU + _EXACT_GELU:
        raise UserError(f"GPT-2 activation {act!r} is not supported; tnlg has GELU in tanh form (activation_function "
                        f"{' or '.join(map(repr, _TANH_GELU))}) or exact ({' or '.join(map(repr, _EXACT_GELU))}).")
    fields = dict(openai_gelu=act in _TANH_GELU,
                  untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True),
                  num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                  num_attention_heads=hf_config.n_head, seq_length=hf_config.n_positions,
                  vocab_size=hf_config.vocab_size, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                  hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  layernorm_epsilon=hf_config.layer_norm_epsilon, init_method_std=hf_config.initializer_range)
    fields.update(overrides)
    return GPTConfig(**fields)


def hf_config_from(cfg: GPTConfig, eod_id: Optional[int] = None):
    """GPT-2 config of ``cfg``; ``bos``/``eos`` are the end-of-document id (GPT-2 uses
    ``<|endoftext|>`` for both), or unset without a tokenizer (GPT-2's default 50256 is
    outside most tnlg vocabularies)."""
    from transformers import GPT2Config
    return GPT2Config(bos_token_id=eod_id, eos_token_id=eod_id,
                      n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                      n_positions=cfg.seq_length, vocab_size=cfg.vocab_size, n_inner=cfg.ffn_hidden_size,
                      resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                      attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
                      initializer_range=cfg.init_method_std,
                      activation_function=_TANH_GELU[0] if cfg.openai_gelu else _EXACT_GELU[0],
                      tie_word_embeddings=not cfg.untie_embeddings_and_output_weights)


def _qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[3h, ...]`` rows in ``[q|k|v]`` order -> per-head ``[head][q,k,v][hd]`` order."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_from_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def hf_to_tnlg_state_dict(hf_sd: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in hf_sd.items():
        if name == "lm_head.weight" and cfg.untie_embeddings_and_output_weights:
            out[name] = t.detach().float().contiguous()
            continue
        if not name.startswith("transformer.") or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # a tied lm_head is wte; attn.bias is GPT-2's causal-mask buffer
        t = t.detach().float()
        if name.endswith(_CONV1D):
            t = t.t()
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = _qkv_to_per_head(t, cfg.num_attention_heads)
        out[name] = t.contiguous()
    return out


def tnlg_to_hf_state_dict(full: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in full.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = _qkv_from_per_head(t, cfg.num_attention_heads)
        if name.endswith(_CONV1D):
            t = t.t()
        out[name] = t.contiguous()
    if not cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def _load_hf_model(model_or_dir):
    if isinstance(model_or_dir, (str, os.PathLike)):
        if not os.path.isdir(model_or_dir):
            raise UserError(f"Hugging Face model folder {str(model_or_dir)!r} does not exist; give a folder "
                            f"written by save_pretrained (config.json + model.safetensors).")
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel.from_pretrained(model_or_dir, local_files_only=True)
    return model_or_dir


def from_hf(model_or_dir, ps: Optional[ParallelState] = None, **overrides):
    """A TP-sharded :class:`tnlg.GPT` with the weights of a GPT-2 model or folder (``overrides``: other
    :class:`~tnlg.config.GPTConfig` fields); at ``ps.pp_size > 1`` this pipeline stage's
    :class:`~tnlg.parallel.pipeline.StageModel` (its layers, by the GPT's names). Each rank keeps its
    slice; no communication."""
    ps = ps or ParallelState.single()
    hf = _load_hf_model(model_or_dir)
    cfg = config_from_hf(hf.config, **overrides)
    model = inference_model(cfg, ps)
    full = hf_to_tnlg_state_dict(hf.state_dict(), cfg)
    if ps.pp_size > 1:  # this stage's parameters only (a name the stage lacks is still a mismatch)
        full = {name: full[name] for name, _ in model.named_parameters() if name in full}
    load_full_state_dict(model, full, ps)
    return model


def build_hf_model(full: dict, cfg: GPTConfig, eod_id: Optional[int] = None, where: str = "the model"):
    """A ``GPT2LMHeadModel`` holding the tnlg full state dict ``full``."""
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel(hf_config_from(cfg, eod_id))
    missing, unexpected = hf.load_state_dict(tnlg_to_hf_state_dict(full, cfg), strict=False)
    missing = [m for m in missing if not m.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise UserError(f"{where} does not map onto GPT-2: missing {missing[:4]}, unexpected {unexpected[:4]}.")
    return hf


def to_hf(model, out_dir: Optional[str] = None, tokenizer=None):
    """Gather a tnlg model into a ``GPT2LMHeadModel`` (collective over TP); optionally write it
    to the new folder ``out_dir`` from the first rank only (:func:`write_hf_folder`: safetensors,
    and the tokenizer files when ``tokenizer`` is given - a :class:`tnlg.data.tokenizer.Tokenizer`
    or anything :func:`~tnlg.data.tokenizer.load_tokenizer` takes). An ``out_dir`` that exists
    and is not empty is refused with a :class:`UserError` (after the gather, on the first rank)."""
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        _check_fits(tok, model.config)
    full = full_state_dict(model, model.ps)
    hf = build_hf_model(full, model.config, None if tok is None else tok.eod_id)
    if out_dir is not None and model.ps.rank == 0:
        write_hf_folder(hf, out_dir, tok)
    return hf


def _check_fits(tok, cfg: GPTConfig) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer {tok!r} has {tok.vocab_size} tokens but the model only {cfg.vocab_size}: "
                        "it is not this model's tokenizer.")


# --------------------------------------------------------------------------- folders

def _not_empty(out: str) -> UserError:
    return UserError(f"Hugging Face folder {out!r} already exists and is not empty; choose a new folder or empty "
                     "it first (an export never deletes or overwrites files it did not write).")


def write_hf_folder(hf, out_dir: str, tokenizer=None) -> str:
    """``save_pretrained(hf)`` (safetensors) plus, with ``tokenizer`` (a tnlg tokenizer or the
    dict of :func:`hf_tokenizer_files`), the tokenizer files, into the new folder ``out_dir``.

    Everything is written to ``<out_dir>.tmp-<pid>`` beside it, then renamed to ``out_dir``,
    so the folder appears complete or not at all. ``out_dir`` must not exist or be an empty
    folder (the rename replaces only an empty one); a failed write removes only the temporary
    folder this call created. Returns the absolute path.
    """
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise _not_empty(out)
    files = tokenizer
    if tokenizer is not None and not isinstance(tokenizer, dict):
        files = hf_tokenizer_files(tokenizer, hf.config.n_positions)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = temporary_name(out)
    try:
        os.mkdir(tmp)
    except FileExistsError:  # not created by this call, so not ours to reuse or remove
        raise UserError(f"temporary folder {tmp!r} already exists (left by an interrupted export?); remove it "
                        "and export again.") from None
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        for name, data in (files or {}).items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        give_umask_mode(tmp)  # save_pretrained leaves model.safetensors at mkstemp's 0600
        try:
            os.replace(tmp, out)  # POSIX rename: replaces an empty folder, refuses a non-empty one
        except OSError:
            if os.path.isdir(out) and not os.listdir(out):
                os.rmdir(out)
                os.replace(tmp, out)
            else:
                raise _not_empty(out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the temporary folder created above, nothing else
        raise
    fsync_dir(os.path.dirname(out))
    return out


# --------------------------------------------------------------------------- tokenizer

# Texts every exported tokenizer must encode exactly as tnlg does (with the vocabulary itself).
_PROBES = ("", " ", "  ", "\n", "Hello, world!", " leading space", "   three leading", "trailing  ",
           "multiple   spaces\tand\ttabs", "\n\nnew\nlines\r\nand CRLF\n", "digits 0123456789 3.14159 1,000",
           "accents é à ü ß ñ", "CJK 中文 日本語 한국어", "RTL שלום مرحبا", "emoji 🎭 👩‍👩‍👧 🇫🇷",
           "▁already ▁escaped▁", "<unk> <s> </s> <pad> <|endoftext|> <0x41>", "ＡＢＣ ﬁ ① ½ \u00a0nbsp\u3000ideo",
           "zero\u200bwidth \x00 \x7f controls", "MiXeD CaSe, punctuation!?;: (brackets) [x] {y} \"quotes\" 'q'")


def hf_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` that encodes every text to ``tok.encode(text)``.

    GPT-2 BPE: tnlg's own pipeline. SentencePiece BPE: built from the model file
    (:func:`_sentencepiece_bpe`). The end-of-document and other control tokens are special
    tokens, matched in text only when ``encode_special_tokens`` is off: it is on here (and
    ``split_special_tokens`` in ``tokenizer_config.json``), as in tnlg, where the text
    ``</s>`` or ``<|endoftext|>`` is ordinary characters. Checked on fixed probe texts and
    the whole vocabulary before it is returned.
    """
    if isinstance(tok, GPT2BPETokenizer):
        backend = _gpt2_bpe(tok)
    elif isinstance(tok, SentencePieceTokenizer):
        backend = _sentencepiece_bpe(tok)
    else:
        raise UserError(f"cannot export tokenizer {tok!r} for Hugging Face: only SentencePiece BPE models and "
                        "GPT-2 BPE folders are supported.")
    backend.encode_special_tokens = True
    _check_same_ids(tok, backend)
    return backend


def _gpt2_bpe(tok):
    import tokenizers
    backend = tokenizers.Tokenizer.from_str(tok.tok.to_str())
    backend.add_special_tokens([tokenizers.AddedToken(tok.EOD_TOKEN, special=True, normalized=False)])
    return backend


def _sentencepiece_bpe(tok):
    """SentencePiece's BPE encoder as a ``tokenizers`` pipeline (the model's settings decide each step).

    * **Model**: BPE over the whole normalised text (SentencePiece does not pre-split; pieces
      never cross a ``▁`` because none was learned that does). SentencePiece merges, at each
      step, the adjacent pair whose concatenation is the normal piece of highest score; the
      merge list is every split ``(left, right)`` of a normal piece into two normal pieces,
      ranked by the score of the piece. ``byte_fallback`` turns unknown characters into
      ``<0xXX>`` pieces; without it runs of unknown characters are one ``<unk>`` (``fuse_unk``).
    * **Normaliser**, in SentencePiece's order: the compiled normalisation rule
      (``Precompiled``; none for ``identity``); with ``remove_extra_whitespaces``, leading and
      trailing spaces dropped and runs of spaces cut to one; spaces escaped as ``▁``; the
      dummy prefix ``▁`` before a non-empty text (``add_dummy_prefix``).
    * **User-defined pieces** are added tokens matched on the normalised text, so they are cut
      out whole and never merged, as SentencePiece does. Limitation: added-token contents go
      through the normaliser too, so a text that is exactly one user-defined piece gets no
      dummy prefix (SentencePiece would emit a lone ``▁`` before it).
    * **Control and unknown pieces** (``<s>``, ``</s>``, ``<unk>``) are special tokens.
    * **Decoder**: ``<unk>`` prints SentencePiece's ``unk_surface``, ``▁`` -> space, byte
      pieces -> UTF-8, the dummy prefix's space dropped.

    Unigram/word/char models, ``treat_whitespace_as_suffix`` and unused pieces (which
    SentencePiece merges through and then splits again) have no exact equivalent: refused.
    """
    import tokenizers
    from tokenizers import models

    m = tok.model()
    _check_exportable(m, tok.path)
    vocab = {piece: i for i, (piece, _, _) in enumerate(m.pieces)}
    normal = {piece: (score, i) for i, (piece, score, t) in enumerate(m.pieces) if t == m.NORMAL}
    ranked = sorted((-score, i, k, piece[:k], piece[k:]) for piece, (score, i) in normal.items()
                    for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal)
    unk = next((piece for piece, _, t in m.pieces if t == m.UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk,
                                              fuse_unk=True, byte_fallback=m.byte_fallback))
    user = sorted((p for p, _, t in m.pieces if t == m.USER_DEFINED), key=len, reverse=True)
    backend.normalizer = _sentencepiece_normalizer(m, user)
    backend.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                                for p, _, t in m.pieces if t in (m.UNKNOWN, m.CONTROL)])
    backend.add_tokens([tokenizers.AddedToken(p, special=False, normalized=True) for p in user])
    backend.decoder = _sentencepiece_decoder(m, unk)
    return backend


def _check_exportable(m, path: str) -> None:
    """A clear error for a SentencePiece model without an exact ``tokenizers`` equivalent."""
    why = None
    if m.model_type != "bpe":
        why = f"it is a {m.model_type} model (only BPE models, what `tnlg train-tokenizer` writes, are supported)"
    elif m.treat_whitespace_as_suffix:
        why = "it was trained with treat_whitespace_as_suffix"
    elif any(t == m.UNUSED for _, _, t in m.pieces):
        why = "it has unused pieces"
    if why:
        raise UserError(f"SentencePiece model {path!r} cannot be exported as a Hugging Face tokenizer: {why}. "
                        "Export the weights alone (tnlg convert --no-tokenizer, or to_hf without a tokenizer).")


def _sentencepiece_normalizer(m, user: list):
    """SentencePiece's normalisation steps, in its order (``user``: the user-defined pieces, longest first)."""
    from tokenizers import Regex, normalizers

    space = "▁" if m.escape_whitespaces else " "
    steps = [normalizers.Precompiled(m.precompiled_charsmap)] if m.precompiled_charsmap else []
    if m.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if m.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if m.add_dummy_prefix:
        # the prefix goes before the whole non-empty text, not before each stretch between user-defined pieces;
        # the look-ahead keeps the pieces' own contents (normalised by tokenizers to build its matcher) unprefixed
        lone = "(?!(?:" + "|".join(_onig_escape(p) for p in user) + r")\z)" if user else ""
        steps.append(normalizers.Replace(Regex(r"\A" + lone + r"(?=[\s\S])"), space))
    return normalizers.Sequence(steps)


def _sentencepiece_decoder(m, unk):
    """``<unk>`` -> its surface, ``▁`` -> space, byte pieces -> UTF-8, the dummy prefix's space dropped."""
    from tokenizers import decoders

    steps = [decoders.Replace(unk, m.unk_surface)] if unk is not None else []
    steps += [decoders.Replace("▁", " ")] if m.escape_whitespaces else []
    steps += [decoders.ByteFallback()] if m.byte_fallback else []
    steps += [decoders.Fuse()] + ([decoders.Strip(" ", 1, 0)] if m.add_dummy_prefix else [])
    return decoders.Sequence(steps)


def _onig_escape(text: str) -> str:
    """``text`` as a literal in a ``tokenizers.Regex`` (Oniguruma syntax)."""
    return "".join("\\" + c if not (c.isalnum() or c == "_" or ord(c) > 127) else c for c in text)


def _check_same_ids(tok, backend) -> None:
    """Refuse a ``backend`` that encodes a probe text or the vocabulary differently from ``tok``."""
    vocab_text = " ".join(tok.decode([i]) for i in range(tok.vocab_size) if i != tok.eod_id)
    for text in (*_PROBES, vocab_text, vocab_text.replace(" ", "")):
        want = list(tok.encode(text))
        got = backend.encode(text, add_special_tokens=False).ids
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise UserError(f"the Hugging Face tokenizer built from {tok!r} would encode {text[:80]!r} as "
                            f"{got[max(0, k - 2):k + 6]} at token {k} where tnlg gives {want[max(0, k - 2):k + 6]}; "
                            "the export stops rather than write a tokenizer that disagrees with the model's training "
                            "ids. Export the weights alone (tnlg convert --no-tokenizer) and please report this "
                            "tokenizer.")


def hf_tokenizer_files(tok, model_max_length: Optional[int] = None) -> dict[str, bytes]:
    """Name -> contents of the tokenizer files of an exported folder: ``tokenizer.json``
    (:func:`hf_tokenizer`), ``tokenizer_config.json``, ``special_tokens_map.json`` (the
    end-of-document token as ``bos_token`` and ``eos_token``) and the source files
    (``tokenizer.model``, or ``vocab.json`` + ``merges.txt``), so tnlg and SentencePiece
    can load the folder too."""
    tok = load_tokenizer(tok)
    backend = hf_tokenizer(tok)
    eod = backend.id_to_token(tok.eod_id)
    special = {"bos_token": eod, "eos_token": eod}
    if not isinstance(tok, GPT2BPETokenizer):  # GPT-2's byte-level BPE has no unknown token
        m = tok.model()
        unk = [p for p, _, t in m.pieces if t == m.UNKNOWN]
        if unk:
            special["unk_token"] = unk[0]
    config = dict(tokenizer_class="PreTrainedTokenizerFast", **special, add_bos_token=False, add_eos_token=False,
                  split_special_tokens=True, clean_up_tokenization_spaces=False)
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    files = {"tokenizer.json": backend.to_str(pretty=True).encode("utf-8"),
             "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8") + b"\n",
             "special_tokens_map.json": json.dumps(special, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"}
    if isinstance(tok, GPT2BPETokenizer):
        sources = {"vocab.json": tok.vocab_file, "merges.txt": tok.merges_file}
    else:
        sources = {"tokenizer.model": tok.path}
    for name, path in sources.items():
        with open(path, "rb") as f:
            files[name] = f.read()
    return files
