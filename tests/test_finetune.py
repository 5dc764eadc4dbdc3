"""``tnlg finetune`` against a plain ``transformers`` reference, at every layout.

The reference fine-tunes the same Hugging Face model (GPT-2, and a Llama with rope and GQA) with plain torch: each
step the whole global batch, labels ``-100`` on the prompts' tokens, the loss the per-token mean over every
counted token of the global batch, ``torch.optim.AdamW`` with decay on matrices only. tnlg loads the same folder
(``tnlg finetune --load HF_DIR``: converted once, weights only), packs or pads the same rows, and trains at TP 1,
TP 2 + SP, CP 2, PP 2 and TP 2 x DP 2 with ZeRO 1. The completions differ in length, so a mean of micro-batch
means would give other losses (checked: that run differs from the reference).
"""

from __future__ import annotations

import json

import pytest
import torch

from .pool import run_distributed


ROWS = [("The king said:", " Long live the queen of all the land."), ("Q: what is two and two?", " Four."),
        ("Translate: good night", " Gute Nacht, mein Freund, gute Nacht."), ("Name a colour.", " Red."),
        ("Who wrote Hamlet?", " William Shakespeare, in about sixteen hundred."), ("Say yes.", " Yes."),
        ("Count to five:", " one two three four five"), ("The sea is", " wide and deep and full of fish.")]
SEQ, ITERS, LR = 64, 5, 2e-3


def _hf_model(kind: str, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=SEQ, vocab_size=4096,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                       rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms and biases off their initial 1 and 0
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _samples(tok):
    """(ids, labels) per row as the definition says: prompt ids + completion ids + eod; the prompt not counted."""
    out = []
    for prompt, completion in ROWS:
        p, c = tok.encode_batch([prompt])[0], tok.encode_batch([completion])[0]
        ids = p + c + [tok.eod_id]
        out.append((ids, [-100] * len(p) + c + [tok.eod_id]))
    return out


def _reference(hf_dir: str, samples) -> list[float]:
    """Plain transformers + torch AdamW: ITERS steps, each on every sample, the per-token mean."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.01),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for _ in range(ITERS):
        opt.zero_grad()
        total, count = torch.zeros(()), 0
        for ids, labels in samples:
            logits = model(torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total = total + torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
        loss = total / count
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train(ps, runs):
    """Each option set trained in this process group (one pool launch per world size)."""
    from tnlg.training import train
    return [train(o)["losses"] for o in runs]


def _options(args_list, world):
    from tnlg.commands.finetune import options
    from tnlg.cli import build_parser
    return [options(build_parser(only="finetune").parse_args(["finetune", *argv]), world) for argv in args_list]


LAYOUTS = {1: [("tp1", [])], 2: [("tp2-sp", ["--tp", "2", "--sequence-parallel"]), ("cp2", ["--cp", "2"]),
                                 ("pp2", ["--pp", "2"])],
           4: [("tp2-dp2-zero1", ["--tp", "2", "--zero-stage", "1"])]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per model kind: the reference losses and tnlg's per layout (packed and not)."""
    from tnlg.data.tokenizer import builtin_tokenizer_path
    from tnlg.data.tokenizer import load_tokenizer
    tmp = tmp_path_factory.mktemp("finetune")
    tok_path = builtin_tokenizer_path()
    tok = load_tokenizer(tok_path)
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    samples = _samples(tok)
    out = {}
    for kind in ("gpt2", "llama"):
        hf_dir = tmp / f"hf-{kind}"
        _hf_model(kind).save_pretrained(hf_dir)
        ref = _reference(str(hf_dir), samples)
        common = ["--load", str(hf_dir), "--tokenizer-model", tok_path, "--sft-data-path", str(rows),
                  "--train-iters", str(ITERS), "--lr", str(LR), "--lr-decay-style", "constant", "--clip-grad", "0",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--no-plot",
                  "--micro-batch-size", "1", "--log-interval", "100"]
        got = {}
        for world, layouts in LAYOUTS.items():
            argvs, names = [], []
            for name, flags in layouts:
                for packed in (True, False) if world <= 2 else (False,):
                    tag = f"{name}-{'packed' if packed else 'padded'}"
                    gbs = len(ROWS) if not packed else _packed_sequences(tok_path, rows)
                    argvs.append(common + flags + ["--global-batch-size", str(gbs), "--save", str(tmp / kind / tag)]
                                 + ([] if packed else ["--no-packing"]))
                    names.append(tag)
            if world == 1:  # the mean of micro-batch means: must not match the reference
                argvs.append(common + ["--global-batch-size", str(len(ROWS)), "--no-packing", "--save",
                                       str(tmp / kind / "micro-means"), "--no-calculate-per-token-loss"])
                names.append("micro-means")
            opts = _options(argvs, world)
            losses = run_distributed(_train, world, 1, opts, timeout_s=300)[0]
            got.update(zip(names, losses))
        out[kind] = (ref, got)
    return out


def _packed_sequences(tok_path, rows) -> int:
    """How many packed sequences the rows make (a global batch of that many sees every sample once)."""
    from tnlg.data.sft import build_sft_datasets
    from tnlg.data.tokenizer import load_tokenizer
    _, _, report = build_sft_datasets(str(rows), None, load_tokenizer(tok_path), SEQ, train_samples=1,
                                      valid_samples=0, seed=1234, packing=True)
    return report.sequences


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fine_tuning_losses_equal_the_transformers_reference_at_every_layout(runs, kind):
    ref, got = runs[kind]
    assert len(got) >= 6
    for name, losses in got.items():
        if name == "micro-means":
            continue
        assert losses == pytest.approx(ref, abs=1e-5), (kind, name, losses, ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_mean_of_micro_batch_means_would_differ(runs, kind):
    """The completions' lengths differ: without the per-token loss the first step's loss is another number."""
    ref, got = runs[kind]
    assert abs(got["micro-means"][0] - ref[0]) > 1e-3, (got["micro-means"][0], ref[0])
