"""``tnlg checkpoint info``: what a checkpoint holds (iteration, layout, config, tokenizer, file sizes),
read from its metadata alone."""

from __future__ import annotations

import json
import os
import sys

import torch

from ..errors import UserError
from . import files as F
from .stages import describe_stages

__all__ = ["info"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def info(path: str, as_json: bool = False, out=None) -> int:
    """Print a checkpoint's iteration, layout, config, tokenizer and file sizes."""
    out = out or sys.stdout
    iter_dir = F.resolve(path, "checkpoint")
    if iter_dir is None:
        raise UserError(f"{path!r} holds no tnlg checkpoint (no {F.LATEST} and no iter_* directory).")
    meta = F.read_meta(iter_dir)
    root = os.path.dirname(iter_dir)
    iterations = F.list_iterations(root)
    sizes = {name: os.path.getsize(os.path.join(iter_dir, name)) if os.path.isfile(os.path.join(iter_dir, name))
             else None for name in meta["files"]}
    if as_json:
        print(json.dumps(dict(meta, path=iter_dir, iterations=iterations, sizes_on_disk=sizes), indent=1), file=out)
        return 0
    cfg, lay, opt = meta["config"], meta.get("layout", {}), meta.get("optimizer", {})
    n_params = sum(int(torch.Size(r["shape"]).numel()) for r in meta["params"].values())
    by_kind: dict[str, int] = {}
    for name, size in meta["files"].items():
        by_kind[name.split("_")[0]] = by_kind.get(name.split("_")[0], 0) + size
    bad = [n for n, s in sizes.items() if s != meta["files"][n]]
    lines = [
        f"checkpoint   {iter_dir}",
        f"iterations   {iterations} in {root} (latest pointer: {F.read_latest(root)})",
        f"iteration    {meta['iteration']} ({meta['consumed_samples']} samples consumed)",
        f"layout       {'PP=' + str(lay['pp']) + ' x ' if lay.get('pp') else ''}TP={lay.get('tp')} x "
        f"DP={lay.get('dp')} ({lay.get('world')} processes), parameters "
        f"{lay.get('param_dtype')}" + (f"; converted from {meta['converted_from']}" if meta.get("converted_from")
                                       else ""),
        f"model        {n_params:,} parameters: " + ", ".join(
            f"{k}={cfg[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                      "ffn_hidden_size", "vocab_size", "hidden_dropout", "attention_dropout")),
        "optimizer    " + (f"AdamW state, step {opt['num_steps']}, "
                           + ("converted from Megatron-LM" if opt.get("converted") else
                              f"saved at ZeRO stage {opt.get('zero_stage')}")
                           + (f", loss scale {opt['loss_scaler']['scale']}" if opt.get("loss_scaler") else "")
                           if opt.get("present") else "none (weights only)"),
        "tokenizer    " + (f"{meta['tokenizer'].get('kind')} "
                            f"{meta['tokenizer'].get('path') or meta['tokenizer'].get('vocab_file')} "
                            f"(vocab {meta['tokenizer'].get('vocab_size')})" if meta.get("tokenizer") else "none"),
    ]
    if meta.get("pipeline"):
        lines.insert(4, f"pipeline     {describe_stages(meta)}")
    if meta.get("data"):
        lines.append(f"data         {[f['prefix'] for f in meta['data']['files']]}, split "
                     f"{meta['options'].get('split')}, seed {meta['options'].get('seed')}")
    if meta.get("schedule"):
        s = meta["schedule"]
        shape = (f"{s['decay_style']} {s['max_lr']} -> {s['min_lr']}, warmup {s['warmup_iters']}, decay until step "
                 f"{s['decay_iters']}, " if s.get("max_lr") is not None else "")
        lines.append(f"lr schedule  {shape}at step {s.get('num_steps')}")
    lines.append(f"files        {len(meta['files'])}, {_mib(sum(meta['files'].values()))}: "
                 + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(by_kind.items())))
    if bad:
        lines.append(f"DAMAGED      {len(bad)} file(s) missing or of the wrong size: {bad[:4]}")
    print("\n".join(lines), file=out)
    return 1 if bad else 0
