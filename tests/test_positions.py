"""The model's positions (``max_position_embeddings``, architecture) apart from the samples' length (``seq_length``,
a training choice): a long-context Hugging Face folder fine-tunes at a short ``--seq-length`` with transformers'
logits, its positions kept through checkpoints, exports and Megatron arguments; packed documents cost O(s) per
sample (their ids), the block-causal mask built where attention runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from .pool import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 32
LONG = {"llama": 131072, "gpt2": 256}


def test_positions_default_to_the_sequence_length_and_bound_it():
    from tnlg.config import GPTConfig
    cfg = GPTConfig(seq_length=48)
    assert cfg.max_position_embeddings == 48
    short = dataclasses.replace(GPTConfig(seq_length=16, max_position_embeddings=64), seq_length=64)
    assert (short.seq_length, short.max_position_embeddings) == (64, 64)
    with pytest.raises(ValueError, match=r"seq_length=128 \(--seq-length\) is longer than the model's "
                                         r"max_position_embeddings=64 positions.*--seq-length 64 or less"):
        GPTConfig(seq_length=128, max_position_embeddings=64)
    # learned positions: one row per position, not per sample token
    a, b = GPTConfig(seq_length=16, max_position_embeddings=64), GPTConfig(seq_length=64)
    assert a.replicated_parameters() == b.replicated_parameters()


def _hf_folder(tmp, kind: str) -> str:
    import transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=LONG[kind], vocab_size=4096,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2)
        model = transformers.GPT2LMHeadModel(cfg)
    else:  # Llama 3.1's shape of positions: 131072, llama3 rope scaling from an 8192 pretraining length
        cfg = transformers.LlamaConfig(
            vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=LONG[kind], rms_norm_eps=1e-5, tie_word_embeddings=False,
            initializer_range=0.2, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192))
        model = transformers.LlamaForCausalLM(cfg)
    path = str(tmp / f"hf-{kind}")
    model.save_pretrained(path)
    return path


def _train(ps, runs):
    from tnlg.training import train
    return [train(o)["losses"] for o in runs]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_long_context_folder_fine_tunes_at_a_short_seq_length(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    from tnlg.checkpoint.files import read_meta, resolve
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import Start, options
    from tnlg.data.tokenizer import builtin_tokenizer_path
    from tnlg.interop.hf import from_hf
    from tnlg.interop.hf_mapping import hf_config_from
    hf_dir = _hf_folder(tmp_path, kind)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"Question {i}?", completion=f" Answer {i}.")) + "\n"
                            for i in range(4)))
    save = tmp_path / "run"
    argv = ["finetune", "--load", hf_dir, "--tokenizer-model", builtin_tokenizer_path(), "--sft-data-path",
            str(rows), "--seq-length", str(SEQ), "--train-iters", "2", "--global-batch-size", "2",
            "--micro-batch-size", "1", "--eval-interval", "0", "--no-plot", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--save", str(save)]
    args = build_parser(only="finetune").parse_args(argv)
    o = Start.of(args).options(1)  # checked, nothing written: the positions are the folder's, the length ours
    assert (o.model.seq_length, o.model.max_position_embeddings) == (SEQ, LONG[kind]) and not save.exists()
    losses = run_distributed(_train, 1, 1, [options(args, 1)], timeout_s=300)[0][0]
    assert len(losses) == 2 and all(x == x for x in losses)
    meta = read_meta(resolve(str(save), "--load"))
    assert (meta["config"]["seq_length"], meta["config"]["max_position_embeddings"]) == (SEQ, LONG[kind])
    cfg = from_hf(hf_dir, seq_length=SEQ).config
    hf_cfg = hf_config_from(cfg)
    assert getattr(hf_cfg, "n_positions" if kind == "gpt2" else "max_position_embeddings") == LONG[kind]
    # the model at the short length computes transformers' logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = from_hf(hf_dir, seq_length=SEQ)(tokens)[..., :4096]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_megatron_arguments_carry_both_lengths():
    from tnlg.config import GPTConfig
    from tnlg.interop.megatron.args import args_for, config_from_args
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=64,
                    vocab_size=96)
    args = args_for(cfg, 1, 1, 0)
    assert (args.seq_length, args.max_position_embeddings) == (16, 64)
    back = config_from_args(args, "args")
    assert (back.seq_length, back.max_position_embeddings) == (16, 64)


def test_a_checkpoint_of_another_length_loads_and_one_of_other_positions_is_refused(tmp_path):
    from tests.fresh_checkpoint import fresh_checkpoint
    from tnlg.checkpoint.compat import check_compatible
    from tnlg.checkpoint.files import read_meta
    from tnlg.config import GPTConfig
    from tnlg.errors import UserError
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=64, vocab_size=96)
    meta = read_meta(fresh_checkpoint(str(tmp_path / "c"), cfg))
    check_compatible(meta, "c", dataclasses.replace(cfg, seq_length=16), None, None, weights_only=True)
    with pytest.raises(UserError, match="max_position_embeddings 64 in the checkpoint vs 128 now"):
        check_compatible(meta, "c", GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                                              max_position_embeddings=128, vocab_size=96), None, None,
                         weights_only=True)
    old = dict(meta, config={k: v for k, v in meta["config"].items() if k != "max_position_embeddings"})
    check_compatible(old, "c", dataclasses.replace(cfg, seq_length=16), None, None, weights_only=True)


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_packed_documents_are_ids_and_attention_builds_their_mask(position):
    from tnlg import GPT, GPTConfig
    from tnlg.data.batch import Batch
    from tnlg.data.sft import sequence_item
    torch.manual_seed(0)
    extra = dict(normalization="RMSNorm", swiglu=True) if position == "rope" else {}
    model = GPT(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=128,
                          position_embedding_type=position, **extra)).eval()
    gen = torch.Generator().manual_seed(2)
    samples = [(torch.randint(0, 128, (n,), generator=gen).numpy(), torch.ones(n, dtype=torch.bool).numpy())
               for n in (7, 12, 5)]
    item = sequence_item(samples, SEQ, 0)
    docs = item["attention_mask"]
    assert docs.shape == (SEQ,) and docs.dtype == torch.int64  # O(s) per sample, no [s, s] matrix
    batch = Batch.collate([item, item])
    dense = (docs[:, None] == docs[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()  # the test's own mask
    with torch.no_grad():
        by_ids = model(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask)
        by_mask = model(batch.tokens, position_ids=batch.position_ids, attention_mask=dense.expand(2, SEQ, SEQ))
        at = 0
        for ids, _ in samples:  # each packed sample: its logits alone
            alone = model(torch.as_tensor(ids)[None])[0]
            torch.testing.assert_close(by_ids[0, at:at + len(ids)], alone, rtol=0, atol=1e-5)
            at += len(ids)
    torch.testing.assert_close(by_ids, by_mask, rtol=0, atol=0)
