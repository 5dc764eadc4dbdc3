"""Engines are freed: building and dropping several engines in one process leaves nothing behind.

A parameter's autograd hooks are held from C++, where the garbage collector cannot see them:
a hook that captures its engine keeps the engine's buffers (4-16 bytes per parameter) alive
for as long as the parameter lives, and a cycle through it is never collected. Each worker
here builds three engines one after another (flat ZeRO-1 in bf16, flat ZeRO-0 with fp32
gradient accumulation, FSDP2 ZeRO-2), trains each for a step, drops it (with its model, or
``close()`` while keeping the model) and checks that every buffer the engine allocated is
gone (weak references to them) and that the bytes of all tensors the interpreter can reach
are back at the baseline taken before the first engine.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref

import torch

from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.optim import build_engine
from .pool import run_distributed

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=96)


def _reachable_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can reach."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objects:
        if o.device.type != "meta":
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _settle(refs, seconds: float = 2.0) -> None:
    """Collect garbage until the referenced tensors are gone or ``seconds`` pass: gloo's worker threads
    drop their references to a finished collective's tensors shortly after ``wait()`` returns."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if all(r() is None for r in refs) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _engine_buffers(engine) -> list[torch.Tensor]:
    """The tensors the backend allocated for the parameters, gradients and optimizer states."""
    b = engine.backend
    if b.impl == "flat":
        return [t for t in (b.param_buffer, b.grad_buffer, b.exp_avg, b.exp_avg_sq, b.master) if t is not None]
    return [p.to_local() for p in b.params] + b.exp_avg + b.exp_avg_sq + [m for m in b.master if m is not None]


def _train_once(ps, stage, dtype, fp32_grads, keep_model):
    model = GPT(GPTConfig(**CFG), ps, device="meta")
    engine = build_engine(model, ps, stage, param_dtype=dtype, accumulate_grads_in_fp32=fp32_grads, lr=1e-3)
    g = torch.Generator().manual_seed(ps.dp_rank)
    tokens = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"]), generator=g)
    engine.zero_grad()
    engine.backward(engine.model(tokens, labels=tokens))
    engine.step()
    refs = [weakref.ref(t) for t in _engine_buffers(engine)]
    kept = engine.model if keep_model else None
    engine.close()
    return refs, kept


LAYOUTS = ((1, torch.bfloat16, False), (0, torch.bfloat16, True), (2, torch.float32, False))


def _worker(ps):
    # warm-up: the first engine of each kind creates lazy, process-lifetime state (RNG, FSDP's
    # device handles), which is not the engine's
    for layout in LAYOUTS:
        _train_once(ps, *layout, keep_model=False)
    baseline = _reachable_tensor_bytes()
    out = []
    for stage, dtype, fp32_grads in LAYOUTS:
        refs, kept = _train_once(ps, stage, dtype, fp32_grads, keep_model=False)
        _settle(refs)
        out.append(dict(stage=stage, alive=sum(r() is not None for r in refs), buffers=len(refs),
                        extra=_reachable_tensor_bytes() - baseline))
    # close() with the model kept (eval after training): the gradient views and hooks go, the parameters stay
    refs, kept = _train_once(ps, 1, torch.bfloat16, True, keep_model=True)
    out.append(dict(kept_grads=sum(p.grad is not None for p in kept.parameters()),
                    kept_hooks=sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                                   for p in kept.parameters())))
    return out


def test_dropped_engines_return_their_memory():
    # fresh processes: the count walks every tensor the process can reach (a pool worker keeps earlier
    # tests' fake tensors and caches)
    for res in run_distributed(_worker, 2, 1, fresh=True):
        for r in res[:3]:
            assert r["alive"] == 0 and r["buffers"] > 0, r
            assert r["extra"] == 0, r  # every engine's bytes came back, not only the big buffers
        assert res[3] == dict(kept_grads=0, kept_hooks=0), res[3]
