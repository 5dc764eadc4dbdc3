"""The seams a block is built on: its layer spec's slots (the MLP, the attention core), the typed batch, and the
auxiliary loss terms a layer adds during the forward, normalised with the language-model loss in one place."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tnlg.config import GPTConfig
from tnlg.data.batch import Batch
from tnlg.model import GPT
from tnlg.model import decoder as decoder_module
from tnlg.model.slots import BlockSpec
from tnlg.model.spec import attention_core, block_spec, dense_mlp
from tnlg.parallel.loss import LossNormalisation
from tnlg.parallel.state import ParallelState

CFG = dict(vocab_size=97, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4, hidden_dropout=0.0,
           attention_dropout=0.0, seed=3)


class _ScaledMLP(nn.Module):
    """An MLP slot of its own: the dense MLP's output times 0.5, and an auxiliary term (the mean square of its
    output, weighted 0.01) added to the forward's context."""

    def __init__(self, cfg, ps, layer_idx, device, init_key):
        super().__init__()
        self.inner, self.layer_idx = dense_mlp(cfg, ps, layer_idx, device, init_key), layer_idx

    def forward(self, x, ctx, synced_bias=None):
        y = self.inner(x, ctx, synced_bias) * 0.5
        ctx.aux[f"square.{self.layer_idx}"] = 0.01 * y.float().pow(2).mean()
        return y


def _tokens(n=2, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randint(0, CFG["vocab_size"], (n, s + 1), generator=g)
    return sample[:, :-1], sample[:, 1:]


def test_the_spec_of_a_layer_is_chosen_from_the_config_in_one_place():
    cfg = GPTConfig(**CFG, sliding_window=4, window_layers=[1, 0])
    ps = ParallelState.single()
    assert [block_spec(cfg, ps, i).window for i in range(2)] == [4, None]
    assert block_spec(cfg, ps, 0).mlp is dense_mlp and block_spec(cfg, ps, 0).core is attention_core
    model = GPT(cfg)
    assert [model.transformer["h"][i].attn.core.window for i in range(2)] == [4, None]  # the core holds the window
    with pytest.raises(ValueError, match="a block is part\\('h', layer=i\\)"):
        model.part("h")
    with pytest.raises(ValueError, match="layers 0..1, not 2"):
        model.part("h", layer=2)


def test_an_mlp_in_the_slot_runs_in_every_block_and_its_auxiliary_terms_reach_the_loss(monkeypatch):
    cfg = GPTConfig(**CFG)
    plain = GPT(cfg)
    monkeypatch.setattr(decoder_module, "block_spec",
                        lambda c, ps, i: BlockSpec(core=attention_core, mlp=_ScaledMLP, window=c.layer_window(i)))
    slotted = GPT(cfg)
    assert all(isinstance(b.mlp, _ScaledMLP) for b in slotted.transformer["h"])
    # the same parameters under the same names (the slot's module holds the dense MLP as `inner`)
    names = {n.replace(".mlp.inner.", ".mlp."): p for n, p in slotted.named_parameters()}
    assert names.keys() == dict(plain.named_parameters()).keys()
    assert all(torch.equal(p, names[n]) for n, p in plain.named_parameters())
    tokens, labels = _tokens()
    mask = (torch.arange(tokens.shape[1]) % 3 != 0).float().expand_as(tokens)
    terms = slotted(Batch(tokens, labels, loss_mask=mask))
    assert sorted(terms.aux) == ["square.0", "square.1"]
    # independent reference: the same blocks by hand (plain torch on the plain model's modules), MLP halved
    with torch.no_grad():
        t = plain.transformer
        x = (t["wte"].weight[tokens] + t["wpe"].weight[:tokens.shape[1]]).transpose(0, 1)
        squares = []
        for block in t["h"]:
            from tnlg.model.forward import ForwardContext
            ctx = ForwardContext()
            x = x + block.attn(block.ln_1(x), ctx)
            y = block.mlp(block.ln_2(x), ctx) * 0.5
            squares.append(0.01 * y.pow(2).mean())
            x = x + y
        logits = F.linear(t["ln_f"](x), t["wte"].weight).transpose(0, 1)[..., :CFG["vocab_size"]]
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        lm = (losses * mask.reshape(-1)).sum() / mask.sum()
    torch.testing.assert_close(terms.total / terms.counted, lm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack([terms.aux["square.0"], terms.aux["square.1"]]), torch.stack(squares))
    loss = LossNormalisation()(terms)
    torch.testing.assert_close(loss, lm + sum(squares), rtol=1e-5, atol=1e-6)
    # per token: the sum over the given divisor, and the auxiliary terms as they are
    torch.testing.assert_close(LossNormalisation(torch.tensor(7.0))(terms), terms.total / 7 + sum(squares))


def test_a_batch_is_typed_from_its_samples_and_refuses_unknown_fields():
    items = [dict(tokens=torch.arange(4), labels=torch.arange(1, 5), loss_mask=torch.ones(4)) for _ in range(3)]
    batch = Batch.collate(items)
    assert batch.tokens.shape == (3, 4) and batch.position_ids is None
    assert float(batch.tokens_counted()) == 12.0
    assert float(Batch(batch.tokens, batch.labels).tokens_counted()) == 12.0
    assert [n for n, _ in Batch.cat([batch, batch]).items()] == ["tokens", "labels", "loss_mask"]
    with pytest.raises(ValueError, match="unknown key\\(s\\) input_ids"):
        Batch.of(dict(input_ids=batch.tokens, labels=batch.labels))
    model = GPT(GPTConfig(**CFG))
    with pytest.raises(ValueError, match="model\\(batch\\) takes everything from the Batch"):
        model(batch, labels=batch.labels)
