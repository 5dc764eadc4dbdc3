"""Low-rank adapters on the tensor-parallel layers against PEFT + transformers + torch's AdamW.

tnlg builds a tiny GPT-2 and a tiny Llama (grouped-query attention, SwiGLU), adds LoRA adapters (``B`` drawn at
random, so the adapters act from the first step) and trains them 5 steps at TP 1 and TP 2 (with and without
sequence parallelism); the reference is the same base exported to transformers, PEFT's ``get_peft_model`` on
it with tnlg's initial factors loaded, and ``torch.optim.AdamW`` on PEFT's trainable parameters. Losses agree
within 1e-5, every adapter gradient is the same at every layout, and the base weights do not move.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from .pool import run_distributed

GPT2 = dict(vocab_size=101, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0, seed=5)
LLAMA = dict(GPT2, num_attention_heads=6, hidden_size=48, group_query_attention=True, num_query_groups=2,
             normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             untie_embeddings_and_output_weights=True, ffn_hidden_size=64)
LLAMA_MHA = dict(LLAMA, group_query_attention=False, num_query_groups=None)
LLAMA_MQA = dict(LLAMA, num_query_groups=1)  # at TP 2 both ranks hold the one key/value group
FAMILIES = {"gpt2": (GPT2, "gpt2"), "llama": (LLAMA, "llama"), "llama_mha": (LLAMA_MHA, "llama"),
            "llama_mqa": (LLAMA_MQA, "llama")}
RANK, ALPHA, LR, STEPS = 4, 16.0, 1e-2, 5


def _tokens(vocab: int):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (2, 12), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole local value (ZeRO 3 holds it as a DTensor sharded over DP)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_tnlg(ps, family: str, targets, sequence_parallel: bool, use_rslora: bool = False, zero_stage: int = 0,
                recompute: Optional[str] = None):
    """tnlg with adapters: the full initial factors, the first step's full adapter gradients, the losses, and
    whether the base weights ended bit-identical (``recompute``: the config's recompute_granularity)."""
    from tnlg.adapters import LoraSettings, adapter_parameters, apply_lora
    from tnlg.config import GPTConfig
    from tnlg.interop.peft import lora_sites
    from tnlg.model import GPT
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.sharding import full_state_dict, gather_full
    fields, layout = FAMILIES[family]
    cfg = GPTConfig(**fields, sequence_parallel=sequence_parallel, recompute_granularity=recompute)
    model = GPT(cfg, ps)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    full_base = full_state_dict(model, ps) if ps.tp_size == 1 else None
    sites = lora_sites([f"transformer.h.{i}" for i in range(cfg.num_layers)], cfg, layout, targets)
    apply_lora(model, LoraSettings(RANK, ALPHA, use_rslora=use_rslora, random_b=True, seed=3), sites,
               head_dim=cfg.head_dim)
    adapters = adapter_parameters(model)
    init = {n: gather_full(p.detach(), p, ps).clone() for n, p in adapters.items()}
    engine = build_engine(model, ps, zero_stage=zero_stage, lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                          clip_grad=0.0)
    assert sorted(engine.param_names) == sorted(adapters), "only the adapters are optimised"
    tokens, labels = _tokens(cfg.vocab_size)
    losses, grads = [], {}
    for step in range(STEPS):
        engine.zero_grad()
        loss = engine.model(tokens, labels=labels)
        engine.backward(loss)
        if step == 0:
            grads = {n: gather_full(engine.grad_view(n).clone(), p, ps) for n, p in adapter_parameters(model).items()}
        engine.step()
        losses.append(loss.item())
    after = {n.replace(".base_layer.", "."): _local(p.detach()) for n, p in model.named_parameters() if n not in adapters}
    same_base = after.keys() == base.keys() and all(torch.equal(after[n], base[n]) for n in base)
    return dict(losses=losses, init=init, grads=grads, same_base=same_base, base=full_base, cfg=cfg)


def _reference(cfg, layout: str, base: dict, init: dict, targets, use_rslora: bool = False) -> list[float]:
    """PEFT on transformers' model of the same base, tnlg's initial factors loaded; AdamW on PEFT's trainables."""
    import peft
    from tnlg.interop.hf import build_hf_model
    from tnlg.interop.peft import peft_adapter_state
    hf = build_hf_model(base, cfg).float().train()
    conf = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(targets),
                           fan_in_fan_out=layout == "gpt2", use_rslora=use_rslora, init_lora_weights=False)
    model = peft.get_peft_model(hf, conf)
    state = {k.replace("base_model.model.", ""): v for k, v in peft_adapter_state(init, cfg, layout).items()}
    missing = peft.set_peft_model_state_dict(model, {f"base_model.model.{k}": v for k, v in state.items()})
    assert not missing.unexpected_keys, missing.unexpected_keys
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(init)
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tokens, labels = _tokens(cfg.vocab_size)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _run(family: str, targets, world: int, sequence_parallel: bool, use_rslora: bool = False, zero_stage: int = 0):
    return run_distributed(_train_tnlg, world, world, family, targets, sequence_parallel, use_rslora, zero_stage)[0]


@pytest.mark.needs_package("peft")
@pytest.mark.parametrize("family,targets", [("gpt2", ("c_attn",)), ("gpt2", ("c_attn", "c_proj", "c_fc")),
                                            ("llama", ("q_proj", "v_proj")),
                                            ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj")),
                                            ("llama_mha", ("q_proj", "v_proj", "up_proj", "down_proj")),
                                            ("llama_mqa", ("k_proj", "v_proj", "o_proj"))])
def test_lora_steps_match_peft_at_tp_1_and_2(family, targets):
    one = _run(family, targets, 1, False)
    layout = FAMILIES[family][1]
    ref = _reference(one["cfg"], layout, one["base"], one["init"], targets)
    assert one["same_base"]
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(ref), rtol=0, atol=1e-5)
    assert ref[-1] < ref[0] - 1e-3  # the adapters learn
    for sp in (False, True):
        two = _run(family, targets, 2, sp)
        assert two["same_base"]
        torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(ref), rtol=0, atol=1e-5)
        assert two["init"].keys() == one["init"].keys()
        for n in one["init"]:
            assert torch.equal(two["init"][n], one["init"][n]), n
            torch.testing.assert_close(two["grads"][n], one["grads"][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.needs_package("peft")
def test_rslora_scaling_matches_peft():
    targets = ("q_proj", "down_proj")
    one = _run("llama", targets, 1, False, use_rslora=True)
    ref = _reference(one["cfg"], "llama", one["base"], one["init"], targets, use_rslora=True)
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(ref), rtol=0, atol=1e-5)


@pytest.mark.needs_package("peft")
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_lora_with_tp_2_by_dp_2_and_zero_matches_peft(zero_stage):
    """The optimizer's states (ZeRO 1) and the parameters (ZeRO 3) of the adapters alone sharded over DP."""
    targets = ("q_proj", "v_proj", "gate_proj", "down_proj")
    one = _run("llama", targets, 1, False)
    ref = _reference(one["cfg"], "llama", one["base"], one["init"], targets)
    four = run_distributed(_train_tnlg, 4, 2, "llama", targets, True, False, zero_stage)[0]
    assert four["same_base"]
    torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(ref), rtol=0, atol=1e-5)


def _logits(model, tokens):
    from tnlg.parallel.vocab import gather_logits
    with torch.no_grad():
        return gather_logits(model.eval()(tokens), model.ps, model.config.vocab_size)


def _export_peft(ps, family: str, targets, out_dir: str):
    """tnlg's model with adapters (random B) written as PEFT's folder; its full base and logits."""
    from tnlg.adapters import LoraSettings
    from tnlg.config import GPTConfig
    from tnlg.interop.peft import add_lora, save_peft_adapter
    from tnlg.model import GPT
    from tnlg.parallel.sharding import full_state_dict
    fields, _ = FAMILIES[family]
    cfg = GPTConfig(**fields)
    model = GPT(cfg, ps)
    base = full_state_dict(model, ps)
    settings = LoraSettings(RANK, ALPHA, random_b=True, seed=7)
    add_lora(model, settings, targets)
    save_peft_adapter(model, out_dir, settings)
    tokens, _ = _tokens(cfg.vocab_size)
    return base, _logits(model, tokens), cfg


def _import_peft(ps, cfg, base: dict, peft_dir: str):
    """tnlg's logits of the base with PEFT's adapter folder loaded."""
    from tnlg.interop.peft import load_peft_adapter
    from tnlg.model import GPT
    from tnlg.parallel.sharding import load_full_state_dict
    model = GPT(cfg, ps)
    load_full_state_dict(model, base, ps)
    load_peft_adapter(model, peft_dir)
    tokens, _ = _tokens(cfg.vocab_size)
    logits = _logits(model, tokens)
    # incremental decoding (the KV cache, one token at a time) calls the adapters too: the same last logits
    from tnlg.model.kv_cache import KVCache
    from tnlg.parallel.vocab import gather_logits
    cache = KVCache(model, tokens.shape[0], tokens.shape[1])
    with torch.no_grad():
        model(tokens[:, :-1], kv_cache=cache, last_only=True)
        last = gather_logits(model(tokens[:, -1:], kv_cache=cache, last_only=True), model.ps, cfg.vocab_size)
    torch.testing.assert_close(last[:, -1], logits[:, -1], rtol=0, atol=1e-5)
    return logits


@pytest.mark.needs_package("peft")
@pytest.mark.parametrize("family,targets", [("gpt2", ("c_attn", "mlp.c_proj")),
                                            ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj")),
                                            ("llama_mha", ("q_proj", "v_proj"))])
def test_peft_folders_out_and_in_give_peft_logits(tmp_path, family, targets):
    """tnlg's adapters written at TP 2 load into peft.PeftModel on the exported base with tnlg's logits; an adapter
    peft made itself (random factors) loaded by tnlg at TP 1 and 2 gives peft's logits."""
    import peft
    from tnlg.interop.hf import build_hf_model
    out = str(tmp_path / "adapter")
    base, logits, cfg = run_distributed(_export_peft, 2, 2, family, targets, out)[0]
    hf = build_hf_model(base, cfg).float().eval()
    model = peft.PeftModel.from_pretrained(hf, out)
    tokens, _ = _tokens(cfg.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
    with torch.no_grad(), model.disable_adapter():
        assert (ref - model(input_ids=tokens).logits).abs().max() > 1e-3  # (the adapters act)

    conf = peft.LoraConfig(r=3, lora_alpha=5.0, target_modules=list(targets), fan_in_fan_out=family == "gpt2",
                           init_lora_weights=False)
    torch.manual_seed(4)
    made = peft.get_peft_model(build_hf_model(base, cfg).float().eval(), conf)
    made.save_pretrained(str(tmp_path / "made"))
    with torch.no_grad():
        expected = made(input_ids=tokens).logits
    for world in (1, 2):
        got = run_distributed(_import_peft, world, world, cfg, base, str(tmp_path / "made"))[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_bad_targets_ranks_and_folders_are_refused_in_one_paragraph(tmp_path):
    import json

    from tnlg.adapters import LoraSettings
    from tnlg.config import GPTConfig
    from tnlg.errors import UserError
    from tnlg.interop.peft import add_lora, load_peft_adapter, save_peft_adapter
    from tnlg.model import GPT
    from tnlg.parallel.state import ParallelState
    cfg = GPTConfig(**LLAMA)
    with pytest.raises(UserError, match=r"'qkv_proj'.*q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
        add_lora(GPT(cfg, ParallelState.single()), LoraSettings(4), ["q_proj", "qkv_proj"])
    with pytest.raises(UserError, match="above the width of k_proj \\(16"):  # 2 groups of 8: k is 16 wide
        add_lora(GPT(cfg, ParallelState.single()), LoraSettings(17), ["q_proj", "k_proj"])
    with pytest.raises(ValueError, match="positive integer"):
        LoraSettings(0)
    model = GPT(cfg, ParallelState.single())
    add_lora(model, LoraSettings(4, random_b=True), ["q_proj"])
    save_peft_adapter(model, str(tmp_path / "a"), LoraSettings(4))
    with pytest.raises(UserError, match=r"transformer.h.0.attn.c_q.lora_A_q_proj is \(4, 48\).*takes \(4, 32\)"):
        load_peft_adapter(GPT(GPTConfig(**dict(LLAMA, hidden_size=32, num_attention_heads=4)),
                              ParallelState.single()), str(tmp_path / "a"))
    conf_file = tmp_path / "a" / "adapter_config.json"
    conf = json.loads(conf_file.read_text())
    conf_file.write_text(json.dumps(dict(conf, use_dora=True)))
    with pytest.raises(UserError, match="use_dora=True.*no DoRA"):
        load_peft_adapter(GPT(cfg, ParallelState.single()), str(tmp_path / "a"))


@pytest.mark.needs_package("peft")
@pytest.mark.parametrize("family,targets", [("gpt2", ("c_attn", "c_proj", "c_fc")),
                                            ("llama", ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")),
                                            ("llama_mha", ("k_proj", "up_proj"))])
def test_merged_adapter_gives_peft_logits(tmp_path, family, targets):
    """``tnlg convert --from CKPT --merge-lora ADAPTER``: the merged tnlg checkpoint (at TP 2) and the merged
    Hugging Face folder give the logits of peft's model with the adapter."""
    import peft
    import transformers
    from tnlg.generation.loading import load_for_inference
    from tnlg.cli import main
    from tnlg.config import GPTConfig
    from tnlg.interop.hf import build_hf_model
    from tnlg.model import GPT
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.state import ParallelState
    fields, layout = FAMILIES[family]
    cfg = GPTConfig(**fields)
    base = full_state_dict(GPT(cfg, ParallelState.single()), ParallelState.single())
    build_hf_model(base, cfg).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ckpt")]) == 0
    torch.manual_seed(2)
    conf = peft.LoraConfig(r=3, lora_alpha=6.0, target_modules=list(targets), fan_in_fan_out=layout == "gpt2",
                           init_lora_weights=False, use_rslora=True)
    made = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), conf)
    made.save_pretrained(tmp_path / "adapter")
    tokens, _ = _tokens(cfg.vocab_size)
    with torch.no_grad():
        expected = made(input_ids=tokens).logits
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--merge-lora", str(tmp_path / "adapter"), "--to", "hf",
                 str(tmp_path / "merged-hf"), "--no-tokenizer"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--merge-lora", str(tmp_path / "adapter"), "--to",
                 str(tmp_path / "merged"), "--tp", "2"]) == 0
    model, _ = load_for_inference(str(tmp_path / "merged"))
    torch.testing.assert_close(_logits(model, tokens), expected, rtol=0, atol=1e-5)


def test_plan_counts_a_frozen_base_and_the_adapters():
    """``tnlg plan --lora-rank``: Llama-3-8B at TP 2, rank 16 on q_proj and v_proj, counted by hand; 2 bytes per
    frozen parameter and 16 per adapter parameter (fp16, ZeRO 0), the frozen ones the planner's own per-rank count."""
    import json
    import subprocess
    import sys

    from tnlg.config import PRESETS, GPTConfig
    from tnlg.plan.counts import parameter_report
    layers, h, d, heads, groups, r = 32, 4096, 128, 32, 8, 16
    adapters = layers * ((r * h + r * heads * d // 2) + (r * h + r * groups * d // 2))
    frozen = parameter_report(GPTConfig(**PRESETS["llama3-8b"]), 2)["per_rank"][0]["params"]
    done = subprocess.run([sys.executable, "-m", "tnlg", "plan", "--preset", "llama3-8b", "--tp", "2", "--world-size",
                           "2", "--zero-stage", "0", "--precision", "fp16", "--lora-rank", "16", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lora = json.loads(done.stdout)["lora"]
    assert (lora["adapter_params"], lora["frozen_params"]) == (adapters, frozen)
    assert lora["total"] == 2 * frozen + 16 * adapters
    assert lora["full_finetuning_total"] == 16 * frozen


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama_mha"])
def test_a_ranks_merge_builds_its_own_shard_of_each_delta_only(tmp_path, family):
    """``merge_peft_adapter`` at TP 2: each rank's merged shards are the slices of the TP 1 merge (``W + s B A`` in
    float64), and no float64 tensor it makes is larger than the rank's largest weight shard (never a whole
    weight's ``B A``)."""
    from tnlg.adapters import LoraSettings, adapter_parameters
    from tnlg.config import GPTConfig
    from tnlg.interop.peft import add_lora, merge_peft_adapter, write_peft_folder
    from tnlg.model import GPT
    from tnlg.parallel.sharding import ShardSpec, shard_of
    from tnlg.parallel.state import ParallelState
    from tnlg.plan.tracker import StepTracker
    fields, layout = FAMILIES[family]
    cfg = GPTConfig(**fields)
    targets = ["all-linear"] if family != "gpt2" else ["c_attn", "c_proj", "c_fc"]
    shapes = GPT(cfg, ParallelState.single(), device="meta")
    add_lora(shapes, LoraSettings(RANK), targets)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(ShardSpec.of(p).shape, generator=g) for n, p in adapter_parameters(shapes).items()}
    write_peft_folder(str(tmp_path), full, cfg, layout, rank=RANK, alpha=ALPHA, dropout=0.0, use_rslora=False)
    whole = GPT(cfg, ParallelState.single(), device="cpu")  # TP 1: every weight's whole delta (peft's logits:
    merge_peft_adapter(whole, str(tmp_path))                  # tests/test_lora_inference.py)
    merged = dict(whole.named_parameters())
    for r in range(2):
        model = GPT(cfg, ParallelState.for_virtual_rank(2, r), device="cpu")
        tracker = StepTracker()
        with tracker:
            merge_peft_adapter(model, str(tmp_path))
        largest = max(p.numel() for n, p in model.named_parameters() if n.endswith(".weight"))
        assert 0 < tracker.largest_new.get(torch.float64, 0) <= largest, (tracker.largest_new, largest)
        adapted = {f.split(".lora_")[0] + ".weight" for f in full}
        assert adapted <= set(merged)
        for n in adapted:
            p = dict(model.named_parameters())[n]
            assert torch.equal(p.detach(), shard_of(merged[n].detach(), p, r)), n


@pytest.mark.slow  # (as the dense llama3-8b simulation: 10 CPU-s)
def test_planned_lora_model_states_are_the_simulated_ones():
    """``tnlg plan --lora-rank 16 --simulate``: Llama-3-8B at TP 2 (rank 0; ZeRO 1 over DP 2, bf16), rank 16 on PEFT's
    default q_proj and v_proj. The planner's model states per rank are what the LoRA step, run on fake tensors at full
    size by the code of ``tnlg finetune`` (the base allocated on the device in bf16 and frozen, the adapters added,
    the engine over them), holds live when its first forward starts, within 5%; the frozen base is 2 bytes a
    parameter there, at setup too."""
    import argparse
    import contextlib
    import io
    import json

    from tnlg.commands.plan import add_arguments, run
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--preset", "llama3-8b", "--seq-length", "512", "--tp", "2", "--dp", "2", "--zero-stage", "1",
            "--precision", "bf16", "--micro-batch-size", "1", "--global-batch-size", "2", "--lora-rank", "16",
            "--simulate", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run(parser.parse_args(argv)) == 0
    plan = json.loads(out.getvalue())
    lora, sim = plan["lora"], plan["simulation"]
    assert sim["layout"]["lora_rank"] == 16 and lora["targets"] == ["q_proj", "v_proj"]
    assert lora["total"] == pytest.approx(sim["model_state_bytes"], rel=0.05), (lora["total"], sim["model_state_bytes"])
    assert sim["model_states"]["frozen_bytes"] == 2 * lora["frozen_params"]
    assert lora["simulated_total"] == sim["model_state_bytes"]
    # setup holds the 16-bit base and one weight's fp32 initial value at a time (the largest: the embedding), never
    # an fp32 copy of the base
    from tnlg.config import PRESETS, GPTConfig
    cfg = GPTConfig(**PRESETS["llama3-8b"])
    setup = next(p for p in sim["phases"] if p["name"] == "setup")
    assert setup["peak_bytes"] <= 1.01 * (sim["model_state_bytes"] + 4 * cfg.padded_vocab_size(1) * cfg.hidden_size), \
        (setup["peak_bytes"], sim["model_state_bytes"])


@pytest.mark.needs_package("peft")
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_lora_with_recomputation_matches_peft(recompute):
    """Activation recomputation runs the adapters again in backward: the same steps."""
    targets = ("q_proj", "k_proj", "o_proj", "up_proj")
    one = _run("llama", targets, 1, False)
    ref = _reference(one["cfg"], "llama", one["base"], one["init"], targets)
    two = run_distributed(_train_tnlg, 2, 2, "llama", targets, True, False, 0, recompute)[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(ref), rtol=0, atol=1e-5)
