"""``tnlg finetune`` with LoRA adapters against PEFT + transformers + torch's AdamW, and its bad input.

The reference fine-tunes PEFT's adapter (made by peft, random factors) on the same Hugging Face model with plain
torch: each step the whole global batch, the per-token mean over the completions' tokens, AdamW. tnlg loads the
same folder (``--load HF_DIR``) and PEFT's adapter (``--load-adapter``), trains, and writes
``SAVE/adapter``, which peft loads onto the base with the reference's trained logits; at TP 1, TP 2 + SP, CP 2,
PP 2 and TP 2 x DP 2 with ZeRO 3.
"""

from __future__ import annotations

import json

import pytest
import torch

from .pool import run_distributed
from .sft_reference import ROWS, finetune_options as _options, hf_model as _hf_model, reference_losses
from .sft_reference import samples as _samples, train as _train

ITERS, LR = 5, 5e-3


def _reference(hf_dir: str, adapter_dir: str, samples):
    """PEFT's adapter of ``adapter_dir`` on the base, trained with torch's AdamW: the losses and the trained model."""
    import peft
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    return reference_losses(model, opt, samples, ITERS), model


@pytest.mark.needs_package("peft")
@pytest.mark.parametrize("kind,targets", [("gpt2", ["c_attn", "mlp.c_fc"]), ("llama", ["q_proj", "v_proj", "down_proj"])])
def test_finetune_with_adapters_matches_peft(tmp_path, kind, targets):
    import peft
    from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
    tok_path = builtin_tokenizer_path()
    samples = _samples(load_tokenizer(tok_path))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    hf_dir, made = tmp_path / "hf", tmp_path / "made"
    hf = _hf_model(kind)
    hf.save_pretrained(hf_dir)
    torch.manual_seed(3)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets, init_lora_weights=False,
                                            fan_in_fan_out=kind == "gpt2")).save_pretrained(made)
    ref, trained = _reference(str(hf_dir), str(made), samples)
    common = ["--load", str(hf_dir), "--tokenizer-model", tok_path, "--sft-data-path", str(rows), "--load-adapter",
              str(made), "--train-iters", str(ITERS), "--lr", str(LR), "--lr-decay-style", "constant",
              "--clip-grad", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0",
              "--no-plot", "--micro-batch-size", "1", "--log-interval", "100", "--global-batch-size", str(len(ROWS)),
              "--no-packing", "--weight-decay", "0.01", "--adam-beta2", "0.999"]
    for world, flags in ((1, []), (2, ["--tp", "2", "--sequence-parallel"]), (2, ["--cp", "2"]), (2, ["--pp", "2"]),
                         (4, ["--tp", "2", "--zero-stage", "3"])):
        save = tmp_path / f"run{world}{'-'.join(flags)}"
        (o,) = _options([common + flags + ["--save", str(save)]], world)
        (losses,) = run_distributed(_train, world, 1, [o], timeout_s=300)[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=0, atol=1e-5)
        # the saved adapter on the base gives the reference's trained logits
        import transformers
        again = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), save / "adapter")
        ids = torch.tensor([samples[0][0]])
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=ids).logits, trained.eval()(input_ids=ids).logits,
                                       rtol=0, atol=1e-5)


def _refusal(argv, capsys) -> str:
    """The paragraph ``tnlg argv`` ends in (run in this process: the refusal comes before any process starts)."""
    from tnlg.cli import main
    capsys.readouterr()
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, (argv, err[-2000:])
    return err


def test_lora_flags_refused_before_any_process_starts(tmp_path, capsys):
    from tnlg.data.tokenizer import builtin_tokenizer_path
    hf_dir = tmp_path / "hf"
    _hf_model("llama").save_pretrained(hf_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    common = ["finetune", "--load", str(hf_dir), "--tokenizer-model", builtin_tokenizer_path(), "--sft-data-path",
              str(rows), "--train-iters", "2", "--nproc-per-node", "1", "--save", str(tmp_path / "s")]
    cases = [(common + ["--lora-rank", "4", "--lora-target-modules", "q_proj", "qkv"],
              "'qkv', which this model does not have"),
             (common + ["--lora-rank", "17", "--lora-target-modules", "k_proj"], "above the width of k_proj (16"),
             (common + ["--lora-rank", "0"], "--lora-rank must be a positive integer"),
             (common + ["--lora-alpha", "16"], "no --lora-rank R"),
             (common + ["--lora-rank", "4", "--zero-impl", "deepspeed"], "is not built yet with --zero-impl deepspeed"),
             (["pretrain", "--lora-rank", "4", "--train-iters", "2", "--nproc-per-node", "1"],
              "that is tnlg finetune")]
    import transformers  # a mixture of experts: adapters on its routed experts are not built
    moe = transformers.MixtralConfig(vocab_size=4096, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(moe).save_pretrained(tmp_path / "moe")
    cases.append(([*common[:2], str(tmp_path / "moe"), *common[3:], "--lora-rank", "4"], "on dense models"))
    for argv, words in cases:
        err = _refusal(argv, capsys)
        assert words in err, (argv, err[-2000:])
    assert not (tmp_path / "s").exists()  # nothing written


@pytest.mark.needs_package("peft")
def test_an_adapter_of_another_base_is_refused_before_any_process_starts(tmp_path, capsys):
    import peft
    from tnlg.data.tokenizer import builtin_tokenizer_path
    hf_dir = tmp_path / "hf"
    _hf_model("llama").save_pretrained(hf_dir)
    other = _hf_model("gpt2")
    peft.get_peft_model(other, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)).save_pretrained(
        tmp_path / "gpt2-adapter")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    common = ["finetune", "--load", str(hf_dir), "--tokenizer-model", builtin_tokenizer_path(), "--sft-data-path",
              str(rows), "--train-iters", "2", "--nproc-per-node", "1", "--save", str(tmp_path / "s")]
    assert "fan_in_fan_out True" in _refusal(common + ["--load-adapter", str(tmp_path / "gpt2-adapter")], capsys)
    assert "brings its own rank" in _refusal(common + ["--load-adapter", str(tmp_path / "gpt2-adapter"),
                                                       "--lora-alpha", "4"], capsys)
    assert not (tmp_path / "s").exists()


@pytest.mark.needs_package("peft")
def test_bf16_adapters_on_a_16_bit_base_track_peft(tmp_path):
    """--bf16: the frozen base in bf16, the adapters with fp32 master weights; the losses track PEFT's fp32 run."""
    import peft
    from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
    tok_path = builtin_tokenizer_path()
    samples = _samples(load_tokenizer(tok_path))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    torch.manual_seed(3)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                        ).save_pretrained(tmp_path / "made")
    ref, _ = _reference(str(tmp_path / "hf"), str(tmp_path / "made"), samples)
    argv = ["--load", str(tmp_path / "hf"), "--tokenizer-model", tok_path, "--sft-data-path", str(rows),
            "--load-adapter", str(tmp_path / "made"), "--train-iters", str(ITERS), "--lr", str(LR),
            "--lr-decay-style", "constant", "--clip-grad", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-interval", "0", "--no-plot", "--micro-batch-size", "1", "--log-interval", "100",
            "--global-batch-size", str(len(ROWS)), "--no-packing", "--weight-decay", "0.01", "--adam-beta2", "0.999",
            "--bf16", "--save", str(tmp_path / "run")]
    (o,) = _options([argv], 1)
    (losses,) = run_distributed(_train, 1, 1, [o], timeout_s=300)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=0, atol=2e-2)
    assert losses[-1] < losses[0] - 0.05
