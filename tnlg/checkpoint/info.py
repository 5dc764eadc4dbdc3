"""``tnlg checkpoint info``: what a checkpoint holds (iteration, layout, config, tokenizer, file sizes),
read from its metadata alone."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from ..config import GPTConfig, arch_fields
from ..errors import UserError
from ..io import file_sha256
from . import files as F
from .manifest import Manifest, OptimizerState, Schedule
from .stages import describe_stages

__all__ = ["info", "verify_files"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def info(path: str, as_json: bool = False, out=None, verify: bool = False) -> int:
    """Print a checkpoint's iteration, layout, config, tokenizer and file sizes; with ``verify`` also check
    every file against the SHA-256 its manifest records (:func:`verify_files`): a file that differs is one
    :class:`UserError` naming it (a non-zero exit)."""
    out = out or sys.stdout
    iter_dir = F.resolve(path, "checkpoint")
    if iter_dir is None:
        raise UserError(f"{path!r} holds no tnlg checkpoint (no {F.LATEST} and no iter_* directory).")
    m = Manifest.read(iter_dir)
    root = os.path.dirname(iter_dir)
    iterations = F.list_iterations(root)
    sizes = {name: os.path.getsize(os.path.join(iter_dir, name)) if os.path.isfile(os.path.join(iter_dir, name))
             else None for name in m.files}
    if as_json:
        verified = verify_files(iter_dir, m) if verify else None
        print(json.dumps(dict(m.to_dict(), path=iter_dir, iterations=iterations, sizes_on_disk=sizes,
                              **({} if verified is None else {"verified_files": verified})), indent=1), file=out)
        return 0
    n_params = sum(math.prod(r.get("shape") or []) for r in m.params.values())  # (shapes checked on reading)
    by_kind: dict[str, int] = {}
    for name, size in m.files.items():
        by_kind[name.split("_")[0]] = by_kind.get(name.split("_")[0], 0) + size
    bad = [n for n, s in sizes.items() if s != m.files[n]]
    lines = [
        f"checkpoint   {iter_dir}",
        f"iterations   {iterations} in {root} (latest pointer: {F.read_latest(root)})",
        f"iteration    {m.iteration} ({m.consumed_samples} samples consumed)",
        f"layout       {_layout(m)}",
        f"model        {n_params:,} parameters: {_architecture(m.config or {})}",
        f"optimizer    {_optimizer(m.optimizer)}",
        f"tokenizer    {_tokenizer(m.tokenizer)}",
    ]
    if m.pipeline:
        lines.insert(4, f"pipeline     {_stages(m, iter_dir)}")
    if (m.config or {}).get("num_experts"):
        lines.insert(lines.index(next(x for x in lines if x.startswith("model "))) + 1, f"experts      {_experts(m)}")
    if m.data:
        options = m.options or {}
        files = m.data.get("files")
        prefixes = [f.get("prefix") for f in files if isinstance(f, dict)] if isinstance(files, list) else files
        lines.append(f"data         {prefixes}, split {options.get('split')}, seed {options.get('seed')}")
    if m.schedule:
        lines.append(f"lr schedule  {_schedule(m.schedule)}")
    lines.append(f"files        {len(m.files)}, {_mib(sum(m.files.values()))}: "
                 + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(by_kind.items())))
    if bad:
        lines.append(f"DAMAGED      {len(bad)} file(s) missing or of the wrong size: {bad[:4]}")
    elif verify:
        n = verify_files(iter_dir, m)
        lines.append(f"verified     {n} file(s) match the SHA-256 recorded when they were written" if n else
                     "verified     nothing: this checkpoint (format 1) records no checksums")
    print("\n".join(lines), file=out)
    return 1 if bad else 0


def verify_files(iter_dir: str, m: Manifest) -> int:
    """How many of the checkpoint's files were checked against the SHA-256 its manifest records (each read once,
    in chunks); a file that is missing, of another size or of other contents: one :class:`UserError` naming every
    such file and what to do."""
    sums = m.sha256 or {}
    wrong = []
    for name in sorted(m.files):
        path = os.path.join(iter_dir, name)
        if not os.path.isfile(path) or os.path.getsize(path) != m.files[name]:
            wrong.append(f"{path!r} (missing, or not of its recorded {m.files[name]:,} bytes)")
        elif name in sums and file_sha256(path) != sums[name]:
            wrong.append(f"{path!r} (its contents differ from the SHA-256 recorded when it was written: a bit flip, "
                         f"or a partial copy of the right size)")
    if wrong:
        raise UserError(f"checkpoint {iter_dir!r} is damaged: {'; '.join(wrong)}. It cannot be trusted: copy "
                        f"the file{'s' if len(wrong) > 1 else ''} again from where the checkpoint was written, or "
                        f"use an earlier iteration." + F.earlier_iterations(iter_dir))
    return sum(1 for name in m.files if name in sums)


def _architecture(config: dict) -> str:
    """Every architecture field :class:`~tnlg.config.GPTConfig` declares, as the checkpoint records it; a
    field declared after the checkpoint was written shows its default (what that checkpoint's model was)."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    return ", ".join(f"{k}={config[k]}" if k in config else f"{k}={defaults[k]} (not recorded: the default)"
                     for k in arch_fields())


def _stages(m: Manifest, iter_dir: str) -> str:
    """The pipeline's stages in words, or a :class:`UserError` where the manifest's ``pipeline`` is not one."""
    try:
        return describe_stages(m)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        raise UserError(f"{os.path.join(iter_dir, 'meta.json')!r} is corrupt: its 'pipeline' entry "
                        f"{json.dumps(m.pipeline.to_dict() if m.pipeline else None)[:80]} is not a list of each stage's layers; the "
                        f"checkpoint cannot be used.") from None


def _layout(m: Manifest) -> str:
    lay = m.layout
    return (f"{'PP=' + str(lay.pp) + ' x ' if lay.pp else ''}TP={lay.tp} x DP={lay.dp}"
            f"{' (EP=' + str(lay.ep) + ')' if lay.ep else ''} ({lay.world} processes), "
            f"parameters {lay.param_dtype}" + (f"; converted from {m.converted_from}" if m.converted_from else ""))


def _experts(m: Manifest) -> str:
    """A mixture of experts' layout: the experts per MoE layer, the EP size it was saved at (each EP rank's experts
    in its own files) and the saved expert biases."""
    cfg = m.config or {}
    E, ep = int(cfg["num_experts"]), m.layout.ep_size
    layers = sum(1 for r in m.params if r.endswith("experts.fc1"))
    spans = [(r * E // ep, (r + 1) * E // ep - 1) for r in range(ep)]
    where = (f"saved at EP {ep}: experts {', '.join(f'{a}-{b}' if b > a else f'{a}' for a, b in spans)} "
             f"in model_*_ep00..ep{ep - 1:02d}" if ep > 1 else "saved at EP 1 (every expert in the model_* files)")
    biases = sum(1 for b in (m.buffers or {}) if b.endswith("expert_bias"))
    return (f"{E} routed per MoE layer ({layers} MoE layer(s)), top-{cfg.get('moe_router_topk')}; {where}; resharded "
            "to any EP size that divides them at load" + (f"; {biases} expert bias(es) saved" if biases else ""))


def _optimizer(opt: OptimizerState) -> str:
    if not opt.present:
        return "none (weights only)"
    return (f"AdamW state, step {opt.num_steps}, "
            + ("converted from Megatron-LM" if opt.converted else f"saved at ZeRO stage {opt.zero_stage}")
            + (f", loss scale {opt.loss_scaler.get('scale')}" if opt.loss_scaler else ""))


def _tokenizer(tok) -> str:
    if not tok:
        return "none"
    return f"{tok.get('kind')} {tok.get('path') or tok.get('vocab_file')} (vocab {tok.get('vocab_size')})"


def _schedule(s: Schedule) -> str:
    shape = (f"{s.decay_style} {s.max_lr} -> {s.min_lr}, warmup {s.warmup_iters}, decay until step "
             f"{s.decay_iters}, " if s.max_lr is not None else "")
    return f"{shape}at step {s.num_steps}"
