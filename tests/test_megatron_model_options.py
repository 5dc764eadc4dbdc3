"""Megatron-LM's model choices tnlg has under its argument names: exact (erf) GELU instead of the
tanh form (``openai_gelu=False``) and an output layer of its own (``untie_embeddings_and_output_weights``).
The whole model at TP 1 and 2 against ``transformers.GPT2LMHeadModel`` with the same weights
(``activation_function="gelu"`` is the exact form there, ``tie_word_embeddings=False`` a separate
``lm_head``), the parameter counts against the built model, and the Hugging Face round trip."""

import pytest
import torch

from tnlg.checkpoint.compat import check_compatible
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.interop.hf import config_from_hf, to_hf
from tnlg.model import GPT
from tnlg.plan.counts import parameter_counts
from .megatron_pool import run_distributed

from .hf_reference import check_against_hf, hf_reference

OPTIONS = [dict(openai_gelu=False, untie=False), dict(openai_gelu=True, untie=True),
           dict(openai_gelu=False, untie=True)]


def _reference(openai_gelu: bool, untie: bool):
    """The GPT-2 reference with the chosen activation and tying; its config read by tnlg must say the same."""
    ref = hf_reference(tanh_gelu=openai_gelu, untied=untie)
    assert config_from_hf(ref.hf.config) == ref.cfg
    return ref


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: f"gelu={'tanh' if o['openai_gelu'] else 'exact'}-"
                                                       f"{'untied' if o['untie'] else 'tied'}")
def test_model_options_match_transformers_at_tp(opts, tp):
    """Exact GELU and the untied head give GPT2LMHeadModel's logits, loss and gradients at TP 1 and 2."""
    ref = _reference(**opts)
    assert ref.cfg.openai_gelu == opts["openai_gelu"]
    assert ref.cfg.untie_embeddings_and_output_weights == opts["untie"]
    assert ("lm_head.weight" in ref.weights) == opts["untie"]
    check_against_hf(tp, tp, ref, tol=1e-5)


def test_untied_exact_gelu_sequence_parallel_matches_transformers():
    """The untied head through the sequence-parallel path (all-gather of the sequence before it)."""
    import dataclasses
    ref = _reference(openai_gelu=False, untie=True)
    check_against_hf(2, 2, ref._replace(cfg=dataclasses.replace(ref.cfg, sequence_parallel=True)), tol=1e-5)


def test_exact_and_tanh_gelu_differ():
    """The choice reaches the MLP: same weights, different activation, different logits."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (1, 8))
    out = []
    for openai_gelu in (True, False):
        model = GPT(GPTConfig(vocab_size=100, seq_length=8, openai_gelu=openai_gelu))
        out.append(model(tokens))
    assert not torch.allclose(out[0], out[1], atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_untied_parameter_counts_match_the_built_model(tp):
    cfg = GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=1000,
                    untie_embeddings_and_output_weights=True)
    tied = GPTConfig(**{**cfg.to_dict(), "untie_embeddings_and_output_weights": False})
    counts = parameter_counts(cfg, tp)
    assert counts["total"] == cfg.num_parameters_formula() == tied.num_parameters_formula() + 1000 * 48
    assert [r["params"] for r in counts["per_rank"]] == [r["params"] for r in cfg.parameters_per_rank(tp)]
    with torch.device("meta"):
        from tnlg.parallel.state import ParallelState
        for r in range(tp):
            model = GPT(cfg, ParallelState.for_virtual_rank(tp, r))
            assert sum(p.numel() for p in model.parameters()) == counts["per_rank"][r]["params"]
            assert model.lm_head.weight.shape == model.transformer.wte.weight.shape


def test_untied_exact_gelu_hf_roundtrip(tmp_path):
    """Exported to a GPT2LMHeadModel folder (activation 'gelu', its own lm_head) and loaded back by
    transformers alone: the same logits as tnlg's model."""
    transformers = pytest.importorskip("transformers")
    cfg = GPTConfig(vocab_size=100, seq_length=8, openai_gelu=False, untie_embeddings_and_output_weights=True)
    model = GPT(cfg).eval()
    hf = to_hf(model, str(tmp_path / "hf"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert loaded.config.activation_function == "gelu" and not loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() != loaded.transformer.wte.weight.data_ptr()
    tokens = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens)[..., :100], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hf(tokens).logits, model(tokens)[..., :100], atol=1e-5, rtol=1e-5)


def test_checkpoint_without_the_fields_is_tanh_and_tied():
    """A checkpoint written before these options existed records neither: it is a tanh, tied model,
    so resuming it with exact GELU or an untied head is refused, and with the defaults accepted."""
    old = {k: v for k, v in GPTConfig().to_dict().items()
           if k not in ("openai_gelu", "untie_embeddings_and_output_weights")}
    meta = dict(config=old)
    check_compatible(meta, "old", GPTConfig(), None, None)
    assert GPTConfig.from_dict(old).openai_gelu and not GPTConfig.from_dict(old).untie_embeddings_and_output_weights
    with pytest.raises(UserError, match="openai_gelu True in the checkpoint vs False"):
        check_compatible(meta, "old", GPTConfig(openai_gelu=False), None, None)
    with pytest.raises(UserError, match="untie_embeddings_and_output_weights False"):
        check_compatible(meta, "old", GPTConfig(untie_embeddings_and_output_weights=True), None, None)


def test_pretrain_flags_set_the_model():
    from tnlg.options.fields import add_options
    from tnlg.options.components import ModelOptions
    import argparse
    parser = argparse.ArgumentParser()
    add_options(parser, ModelOptions, {})
    assert vars(parser.parse_args([])) == {}
    assert vars(parser.parse_args(["--no-openai-gelu"])) == {"openai_gelu": False}
    assert vars(parser.parse_args(["--openai-gelu"])) == {"openai_gelu": True}
    assert vars(parser.parse_args(["--untie-embeddings-and-output-weights"])) == {
        "untie_embeddings_and_output_weights": True}


def _options(world, **over):
    from tests.tiny import tiny_options
    load = over.pop("load", None)
    o = tiny_options(world, **{**dict(train_iters=6, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, lr_decay_iters=6,
                                      log_interval=100, eval_iters=1, hidden_dropout=0.0, attention_dropout=0.0,
                                      openai_gelu=False, untie_embeddings_and_output_weights=True,
                                      tensor_model_parallel_size=2), **over})
    o.checkpoint.load = load
    return o


def _train_legs(ps, runs):
    from tnlg.training import train
    return [train(o)["losses"] for o in runs]


def test_untied_exact_gelu_checkpoint_resumes_exactly_and_reshards(tmp_path):
    """Saved at TP 2 (the untied head is a new parameter of the checkpoint), resumed at TP 2 and at
    TP 1: the same losses as the uninterrupted run; resuming with the tied head is refused."""
    save = str(tmp_path / "run")
    runs = [_options(2), _options(2, train_iters=3, save=save), _options(2, load=save, save=str(tmp_path / "a")),
            _options(2, tensor_model_parallel_size=1, load=save, save=str(tmp_path / "b"))]
    whole, first, resumed, resharded = run_distributed(_train_legs, 2, 1, runs, timeout_s=180)[0]
    from tnlg.checkpoint.files import read_meta, resolve
    assert "lm_head.weight" in read_meta(resolve(save))["params"]
    torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(whole), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.tensor(first + resharded), torch.tensor(whole), atol=1e-5, rtol=1e-5)
    with pytest.raises(UserError, match="untie_embeddings_and_output_weights True in the checkpoint vs False"):
        check_compatible(read_meta(resolve(save)), save, GPTConfig(**{
            **GPTConfig.from_dict(read_meta(resolve(save))["config"]).to_dict(),
            "untie_embeddings_and_output_weights": False}), None, None)
