"""A tnlg checkpoint of a freshly initialised model, written in one process (TP 1, no optimizer state): the
starting point of the conversion and hostile-input tests."""

from __future__ import annotations


def fresh_checkpoint(path: str, cfg, iteration: int = 3, tokenizer=None) -> str:
    """Write ``cfg``'s seeded initial weights as a tnlg checkpoint at ``path`` (iteration ``iteration``), recording
    ``tokenizer`` (a loaded tnlg tokenizer) if given; its ``iter_*`` folder."""
    from tnlg.checkpoint.files import FORMAT
    from tnlg.checkpoint.reshard import slice_full, targets_for
    from tnlg.checkpoint.saving import write_offline
    from tnlg.model import GPT
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.state import ParallelState
    full = full_state_dict(GPT(cfg), ParallelState.single())
    meta = dict(format=FORMAT, iteration=iteration, consumed_samples=0, config=cfg.to_dict(), options={}, data=None,
                tokenizer=None if tokenizer is None else tokenizer.describe(), layout=dict(param_dtype="float32"), optimizer=dict(present=False), schedule=None)
    layout = GPT.describe(cfg, 1)
    targets = targets_for(layout, 0)
    return write_offline(path, meta, 1, lambda r, names: ({n: slice_full(full[n], targets[n]) for n in names}, None),
                         layout=layout)


def builtin_tokenizer_checkpoint(path: str, **config) -> str:
    """:func:`fresh_checkpoint` of ``GPTConfig(**config)`` at the built-in tokenizer's vocabulary, recording that
    tokenizer (what ``tnlg finetune --load`` of a tnlg checkpoint reads its tokenizer from)."""
    from tnlg.config import GPTConfig
    from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
    tok = load_tokenizer(builtin_tokenizer_path())
    return fresh_checkpoint(path, GPTConfig(**config, vocab_size=tok.vocab_size), tokenizer=tok)


def question_rows(path, n: int):
    """``n`` prompt/completion rows (``Question i?`` / `` Answer i.``) as JSON Lines at ``path``; ``path``."""
    import json
    path.write_text("".join(json.dumps(dict(prompt=f"Question {i}?", completion=f" Answer {i}.")) + "\n"
                            for i in range(n)))
    return path
