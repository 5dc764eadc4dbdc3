"""Megatron-LM checkpoints with ``--kv-channels`` apart from hidden / heads, ``--qk-layernorm`` and a sliding
window (``--window-size 4 0 --window-attn-skip-freq 2``: the first layer slides, the second attends to
everything), in and out, against megatron-core itself (tests/megatron_reference.py).

megatron-core's GPTModel (local spec, RMSNorm on each head's queries and keys) at Megatron TP 2, random
weights, saved by its own code in both formats: the converted tnlg checkpoints give Megatron's logits at tnlg
TP 1 and 2, and exported back (torch_dist at TP 1, legacy at TP 2) they load into GPTModel with the same logits
and the args a Megatron run of those flags saves.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.needs_package("megatron.core")  # the reference: megatron-core itself

from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint  # noqa: E402
from .megatron_pool import run_distributed  # noqa: E402

from . import megatron_reference as R  # noqa: E402
from .test_megatron_checkpoint import _logits_at, _megatron_loads  # noqa: E402

ATTN = dict(kv_channels=12, qk_layernorm=True, window_size=(4, 0), window_attn_skip_freq=2)
SPEC = dict(layers=2, hidden=32, heads=4, ffn=48, seq=16, vocab=100, divisible=8, pp=1, tp=2, openai_gelu=False,
            untie=True, llama=dict(groups=2, rotary_base=10000.0, rotary_percent=1.0, eps=1e-6, qkv_bias=False),
            attn=ATTN)
TOL = dict(atol=1e-5, rtol=1e-5)


def _tokens(spec):
    return torch.randint(0, spec["vocab"], (2, spec["seq"]), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Megatron's logits and its checkpoints (both formats) converted to tnlg: ``(root, logits, {fmt: path})``."""
    root = tmp_path_factory.mktemp("megatron_attention")
    ref = run_distributed(R.save_reference, 2, 1, SPEC, str(root), _tokens(SPEC), timeout_s=240)[0]
    converted = {fmt: megatron_to_checkpoint(str(root / fmt), str(root / f"tnlg_{fmt}")) for fmt in ("legacy",
                                                                                                     "torch_dist")}
    return root, ref, converted


def test_import_reads_the_head_width_qk_norm_and_window_with_megatrons_logits(run):
    from tnlg.generation.loading import load_for_inference
    _, ref, converted = run
    cfg = load_for_inference(converted["torch_dist"])[0].config
    assert (cfg.kv_channels, cfg.qk_layernorm, cfg.sliding_window, cfg.window_layers) == (12, True, 5, [1, 0])
    for tp, per_checkpoint in _logits_at(list(converted.values()), SPEC, (1, 2)).items():
        for logits in per_checkpoint:
            torch.testing.assert_close(logits, ref, **TOL, msg=lambda m, tp=tp: f"tnlg TP {tp}: {m}")


def test_export_loads_into_megatron_with_the_same_logits(run, tmp_path):
    root, ref, converted = run
    loads, saved = [], []
    for fmt, tp in (("torch_dist", 1), ("legacy", 2)):
        dst = tmp_path / f"{fmt}_{tp}"
        it_dir = checkpoint_to_megatron(converted["legacy" if fmt == "torch_dist" else "torch_dist"], str(dst),
                                        fmt=fmt, tp=tp)
        common = os.path.join(it_dir, "common.pt" if fmt == "torch_dist" else "mp_rank_00/model_optim_rng.pt")
        saved.append(vars(torch.load(common, weights_only=False)["args"]))
        loads.append((dict(SPEC, tp=tp), str(dst), fmt, _tokens(SPEC)))
    results = run_distributed(_megatron_loads, 2, 1, loads, timeout_s=300)[0]
    for out, args in zip(results, saved):
        torch.testing.assert_close(out["logits"], ref, **TOL)
        assert {k: args[k] for k in ATTN} == {**ATTN, "window_attn_skip_freq": [1, 0]}
