"""What the fine-tuning tests share: the rows, the small Hugging Face models, the samples as the definition makes
them, the reference training loop in plain torch, and tnlg's run of the same options.

The reference (:func:`reference_losses`) trains any ``transformers`` model (the model itself, or PEFT's wrapper of
it) with the optimizer it is given: each step the whole global batch, labels ``-100`` on the prompts' tokens, the
loss the per-token mean over every counted token of the global batch.
"""

from __future__ import annotations

import torch

ROWS = [("The king said:", " Long live the queen of all the land."), ("Q: what is two and two?", " Four."),
        ("Translate: good night", " Gute Nacht, mein Freund, gute Nacht."), ("Name a colour.", " Red."),
        ("Who wrote Hamlet?", " William Shakespeare, in about sixteen hundred."), ("Say yes.", " Yes."),
        ("Count to five:", " one two three four five"), ("The sea is", " wide and deep and full of fish.")]
SEQ = 64


def hf_model(kind: str, seed: int = 0):
    """A small random GPT-2 (``gpt2``) or Llama with grouped-query attention (``llama``), norms and biases off their
    initial 1 and 0."""
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
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def samples(tok):
    """(ids, labels) per row as the definition says: prompt ids + completion ids + eod; the prompt not counted."""
    out = []
    for prompt, completion in ROWS:
        p, c = tok.encode_batch([prompt])[0], tok.encode_batch([completion])[0]
        ids = p + c + [tok.eod_id]
        out.append((ids, [-100] * len(p) + c + [tok.eod_id]))
    return out


def reference_losses(model, opt, samples_, iters: int) -> list[float]:
    """``iters`` steps of ``opt`` on ``model`` (a causal LM of ``transformers``, or PEFT's wrapper), each on every
    sample at once: the per-token mean of the counted tokens' cross-entropy. The losses, step by step."""
    losses = []
    for _ in range(iters):
        opt.zero_grad()
        total, count = torch.zeros(()), 0
        for ids, labels in samples_:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total = total + torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
        loss = total / count
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def folder_losses(folder, samples_, iters: int, lr: float) -> list[float]:
    """The Hugging Face folder's model (fp32) trained by :func:`reference_losses` with ``torch.optim.AdamW``: decay
    0.01 on matrices only, betas (0.9, 0.999), eps 1e-8, learning rate ``lr`` held."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.01),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    return reference_losses(model, opt, samples_, iters)


def train(ps, runs):
    """Each option set trained in this process group (one pool launch per world size): the losses of each."""
    from tnlg.training import train as train_run
    return [train_run(o)["losses"] for o in runs]


def finetune_options(args_list, world):
    """``tnlg finetune``'s options of each argument list, on ``world`` processes (its checks made, ``SAVE``'s
    record written, a foreign ``--load`` converted)."""
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import options
    return [options(build_parser(only="finetune").parse_args(["finetune", *argv]), world) for argv in args_list]
