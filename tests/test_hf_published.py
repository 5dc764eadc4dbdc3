"""Published decoder configs that change the attention: scaled rope (Llama 3.1/3.2's ``llama3``, ``linear``,
``yarn``, ``dynamic``), GPT-2's ``scale_attn_weights`` / ``scale_attn_by_inverse_layer_idx``, Llama's
``attention_bias`` / ``mlp_bias``. Each is a folder transformers saves (random weights, shrunk in size
only, ``original_max_position_embeddings`` shrunk to 16 so the sequences run past it), read by tnlg and
compared with transformers' own logits at TP 1 and TP 2, greedy generation with the KV cache, packed
documents (positions restarting), CP 2's loss, and a round trip's config.json."""

from __future__ import annotations

import json

import pytest
import torch

from .hf_reference import random_gpt2
from .llama_reference import random_llama
from .pool import run_distributed

transformers = pytest.importorskip("transformers")

SEQ, ORIGINAL, VOCAB = 48, 16, 100
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=ORIGINAL)
MODELS = {  # name -> (kind, config fields)
    "llama3.1": ("llama", dict(rope_parameters=LLAMA3)),
    "llama3.2": ("llama", dict(rope_parameters=dict(LLAMA3, factor=32.0), tie_word_embeddings=True)),
    "linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "dynamic": ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "yarn": ("qwen2", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=3.0,
                                                original_max_position_embeddings=ORIGINAL))),
    "yarn-mscale": ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=3.0, beta_fast=8.0,
                                                       mscale=0.8, mscale_all_dim=0.5, truncate=False,
                                                       original_max_position_embeddings=ORIGINAL))),
    "attention_bias": ("llama", dict(attention_bias=True)),
    "mlp_bias": ("llama", dict(mlp_bias=True)),
    "both_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "gpt2-layer-idx": ("gpt2", dict(scale_attn_by_inverse_layer_idx=True)),
    "gpt2-unscaled": ("gpt2", dict(scale_attn_weights=False)),
    "gpt2-upcast": ("gpt2", dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)),
}


def _model(name: str):
    kind, fields = MODELS[name]
    if kind == "gpt2":
        return random_gpt2(VOCAB, SEQ, n_layer=3, std=0.1, bos_token_id=0, eos_token_id=0, **fields)
    return random_llama(kind, layers=2, seq=SEQ, vocab=VOCAB, **fields)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every model's folder (save_pretrained) and transformers' logits of one batch of ``SEQ`` tokens."""
    root = tmp_path_factory.mktemp("published")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in MODELS:
        hf = _model(name)
        hf.save_pretrained(root / name)
        with torch.no_grad():
            out[name] = (str(root / name), hf(tokens).logits)
    return tokens, out


def _logits(ps, paths: dict, tokens, sequence_parallel: bool = False) -> dict:
    from tnlg.interop.hf import from_hf
    from tnlg.model import gather_logits
    with torch.no_grad():
        return {name: gather_logits(from_hf(path, ps, sequence_parallel=sequence_parallel)(tokens), ps, VOCAB)
                for name, path in paths.items()}


def test_each_published_config_loads_with_transformers_logits_at_tp_1(folders):
    from tnlg.parallel.state import ParallelState
    tokens, models = folders
    got = _logits(ParallelState.single(), {n: p for n, (p, _) in models.items()}, tokens)
    for name, (_, ref) in models.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5, msg=name)


def _tp_2(ps, paths: dict, tokens) -> dict:
    return {sp: _logits(ps, paths, tokens, sp) for sp in (False, True)}


def test_each_published_config_loads_with_transformers_logits_at_tp_2_with_and_without_sp(folders):
    tokens, models = folders
    for rank in run_distributed(_tp_2, 2, 2, {n: p for n, (p, _) in models.items()}, tokens):
        for sp in (False, True):
            for name, (_, ref) in models.items():
                torch.testing.assert_close(rank[sp][name], ref, rtol=1e-5, atol=1e-5, msg=f"{name} sp={sp}")


def test_each_published_config_loads_with_transformers_logits_at_tp_4(folders):
    """Four ranks: the query heads split unevenly where they do not divide, the KV groups shared (GQA ratio kept)."""
    tokens, models = folders
    for rank in run_distributed(_logits, 4, 4, {n: p for n, (p, _) in models.items()}, tokens):
        for name, (_, ref) in models.items():
            torch.testing.assert_close(rank[name], ref, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["llama3.1", "yarn", "linear", "dynamic", "gpt2-layer-idx"])
def test_greedy_generation_past_the_original_length_matches_transformers(folders, name):
    """Scaled rope (the KV cache from a 10-token prompt to position 40; the original length is 16) and GPT-2's
    per-layer scaling: transformers' greedy tokens."""
    from tnlg.generation.generator import generate_ids
    from tnlg.interop.hf import from_hf
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[1][name][0]).eval()
    hf.generation_config.eos_token_id = None  # (30 tokens whatever they are, as tnlg's stop_at_eod=False)
    prompt = folders[0][0, :10].tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 10, dtype=torch.long),
                           max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 10:].tolist()
    got = generate_ids(from_hf(folders[1][name][0]), [prompt], 30, greedy=True, stop_at_eod=False)[0]
    assert len(want) == 30 and got == want


def test_an_older_folder_spelling_rope_scaling_with_type_loads_the_same_model(folders, tmp_path):
    """``rope_scaling`` with ``type`` and a top-level ``rope_theta`` (folders written before transformers 5)."""
    import shutil
    from tnlg.interop.hf import from_hf
    path, ref = folders[1]["linear"]
    shutil.copytree(path, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=10000.0)
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        got = from_hf(str(tmp_path / "old"))(folders[0])[..., :VOCAB]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert from_hf(str(tmp_path / "old")).config.rope_scaling_factor == 4.0


def test_packed_documents_take_their_own_positions_under_llama3_rope(folders):
    """Two documents packed in one sequence (``--reset-position-ids``, a document mask): the second one's
    logits are transformers' of it alone (positions from 0, past the original length)."""
    from tnlg.interop.hf import from_hf
    path, _ = folders[1]["llama3.1"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokens = folders[0][:1]
    cut = 20
    positions = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]).unsqueeze(0)
    doc = torch.zeros(SEQ, dtype=torch.long)
    doc[cut:] = 1
    mask = (doc[:, None] == doc[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    with torch.no_grad():
        want = hf(tokens[:, cut:]).logits
        got = from_hf(path)(tokens, position_ids=positions, attention_mask=mask.unsqueeze(0))[..., :VOCAB]
    torch.testing.assert_close(got[:, cut:], want, rtol=1e-5, atol=1e-5)


CP_MODELS = ("llama3.1", "yarn", "gpt2-layer-idx")


def _cp_and_pp(ps, paths: dict, batch: dict, tokens) -> dict:
    """CP 1 and 2's losses, then PP 2's logits (the last stage's; layer indices global on each stage)."""
    from tnlg.interop.hf import from_hf
    from tnlg.model import gather_logits
    from tnlg.model.inference import forward_logits
    from tnlg.parallel.state import init_parallel
    out = _cp_losses(ps, paths, batch)
    ps = init_parallel(1, pipeline_parallel_size=2)
    for name, path in paths.items():
        with torch.no_grad():
            logits = forward_logits(from_hf(path, ps), tokens)
        out[("pp", name)] = None if logits is None else gather_logits(logits, ps, VOCAB)
    return out


def _cp_losses(_ps, paths: dict, batch: dict) -> dict:
    from tnlg.interop.hf_reader import read_hf_folder
    from tnlg.model import GPT
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.parallel.sharding import load_full_state_dict
    from tnlg.parallel.state import init_parallel
    out = {}
    for cp in (1, 2):
        ps = init_parallel(context_parallel_size=cp)
        for name, path in paths.items():
            cfg, full = read_hf_folder(path)
            model = GPT(cfg, ps)
            load_full_state_dict(model, full, ps)
            for docs in (False, True):
                mine = {k: v for k, v in batch.items() if docs or k in ("tokens", "labels", "loss_mask")}
                mine = context_parallel_batch(mine, ps)
                with torch.no_grad():
                    out[(name, cp, docs)] = float(model(mine.tokens, labels=mine.labels,
                                                        loss_mask=mine.loss_mask,
                                                        position_ids=mine.position_ids,
                                                        attention_mask=mine.attention_mask))
    return out


def test_context_parallel_loss_equals_cp_1_and_pp_2_gives_transformers_logits(folders):
    """CP 2 (the ring; global positions past the original length on the second rank's chunks; with documents,
    positions restarting per document) gives CP 1's loss; PP 2 transformers' logits: llama3 and yarn rope,
    GPT-2's per-layer scaling (the second stage's layers scaled by their global index)."""
    from tnlg.data.gpt_dataset import _make_item
    samples = torch.randint(1, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    samples[0, 13] = samples[1, 30] = 0
    items = [_make_item(s, 0, False, True, True) for s in samples]
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    paths = {name: folders[1][name][0] for name in CP_MODELS}
    results = run_distributed(_cp_and_pp, 2, 1, paths, batch, folders[0])
    for rank in results:
        for name in CP_MODELS:
            for docs in (False, True):
                assert rank[(name, 2, docs)] == pytest.approx(rank[(name, 1, docs)], rel=1e-6, abs=1e-6), name
    for name in CP_MODELS:
        assert results[0][("pp", name)] is None
        torch.testing.assert_close(results[1][("pp", name)], folders[1][name][1], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["llama3.1", "yarn-mscale", "dynamic", "both_biases", "attention_bias",
                                  "gpt2-layer-idx", "gpt2-unscaled"])
def test_a_round_trip_leaves_the_architectural_fields_equal(folders, tmp_path, name):
    from tnlg.interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    path, _ = folders[1][name]
    hf_to_checkpoint(path, str(tmp_path / "ck"))
    checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"), with_tokenizer=False)
    before, after = (json.loads(open(p + "/config.json").read()) for p in (path, str(tmp_path / "out")))
    keys = ("rope_parameters", "attention_bias", "mlp_bias", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
            "model_type", "max_position_embeddings", "n_positions", "tie_word_embeddings")
    assert {k: after.get(k) for k in keys} == {k: before.get(k) for k in keys}


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "linear", "dynamic", "yarn", "yarn-mscale"])
def test_the_inverse_frequencies_are_transformers_own(folders, name):
    """tnlg's inverse frequencies and cos/sin factor are bit for bit ``ROPE_INIT_FUNCTIONS``' (dynamic: also for a
    forward longer than ``max_position_embeddings``, which transformers computes from the longest position)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from tnlg.interop.hf_reader import check_hf_folder
    from tnlg.parallel.rotary import scaled_frequencies
    found = check_hf_folder(folders[1][name][0])
    hf_config, cfg = found.hf_config, found.cfg
    init = ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]]
    for seq_len in (None, torch.tensor(SEQ), torch.tensor(3 * SEQ + 5)):
        want = init(hf_config, None, seq_len=seq_len)
        got = scaled_frequencies(cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling, seq_len=seq_len)
        assert torch.equal(got[0], want[0]) and got[1] == want[1], (name, seq_len)
    if name == "dynamic":  # (the longer forward's frequencies are the grown base's, not the default's)
        assert not torch.equal(scaled_frequencies(cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling,
                                                  seq_len=torch.tensor(3 * SEQ))[0],
                               scaled_frequencies(cfg.rotary_dim, cfg.rotary_base, None)[0])


@pytest.mark.parametrize("name", ["attention_bias", "mlp_bias", "both_biases"])
def test_the_planner_counts_the_biases_transformers_holds(folders, name):
    import tnlg
    from tnlg.interop.hf import from_hf
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[1][name][0])
    model = from_hf(folders[1][name][0])
    want = sum(p.numel() for p in hf.parameters())
    assert tnlg.parameter_counts(model.config, 1)["total"] == want == model.config.num_parameters_formula()


@pytest.mark.parametrize("name", ["llama3.1", "yarn", "yarn-mscale", "attention_bias", "mlp_bias", "gpt2-layer-idx",
                                  "gpt2-unscaled"])
def test_training_gradients_are_transformers_own(folders, name):
    """The loss and every weight's gradient (the test's own mapping of transformers' names) at TP 1 within 1e-5."""
    from tnlg.interop.hf_reader import read_hf_folder
    from tnlg.model import GPT
    from tnlg.parallel.sharding import load_full_state_dict
    from tnlg.parallel.state import ParallelState
    from .hf_reference import tnlg_weights_from_hf as gpt2_weights
    from .llama_reference import tnlg_weights_from_hf as llama_weights
    path = folders[1][name][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokens = folders[0]
    labels = torch.roll(tokens, -1, 1)
    loss = torch.nn.functional.cross_entropy(hf(tokens).logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    cfg, full = read_hf_folder(path)
    model = GPT(cfg, ParallelState.single())
    load_full_state_dict(model, full, ParallelState.single())
    got = model(tokens, labels=labels)
    got.backward()
    c = hf.config
    want = gpt2_weights(grads, c.n_head) if MODELS[name][0] == "gpt2" else \
        llama_weights(grads, c.num_attention_heads, c.num_key_value_heads)
    torch.testing.assert_close(got, loss, rtol=1e-5, atol=1e-5)
    mine = {n: p.grad for n, p in model.named_parameters()}
    assert set(mine) == set(want)
    for n, g in want.items():
        padded = n.endswith("wte.weight") or n == "lm_head.weight"  # (the vocabulary's padded rows: no gradient)
        torch.testing.assert_close(mine[n][:g.shape[0]] if padded else mine[n], g, rtol=1e-5, atol=1e-5,
                                   msg=f"{name}: {n}")
