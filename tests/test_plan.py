"""``tnlg plan``: ZeRO Table 1, meta-device counts, the T-NLG layouts, uneven heads, errors.

The CLI runs in-process (``tnlg.cli.main``) with ``capsys``; nothing here allocates
model memory (shards are built on the meta device).
"""

from __future__ import annotations

import json

import pytest

from tnlg.cli import main
from tnlg.config import PRESETS, GPTConfig
from tnlg.errors import UserError
from tnlg.plan.counts import parameter_counts, rank_counts_formula, replicated_per_rank
from tnlg.plan.flops import flops_per_iteration, rank_flops_imbalance, reference_flops
from tnlg.plan.memory import activation_bytes, model_state_bytes
from tnlg.plan.units import parse_bytes, parse_count


def plan_json(capsys, *argv) -> dict:
    """Run ``tnlg plan ... --json`` in-process; stdout must be exactly one JSON object."""
    capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)  # fails on anything besides one JSON document
    assert isinstance(obj, dict)
    return obj


def plan_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    return captured.err


# --- ZeRO paper, Table 1 ---------------------------------------------------------------------
# Nd -> {model: (stage 1, stage 2, stage 3)} as printed in the paper (GB = 1e9 bytes).
TABLE1 = {
    1: {"7.5e9": ("120", "120", "120"), "1.28e+11": ("2048", "2048", "2048"), "1e12": ("16000", "16000", "16000")},
    4: {"7.5e9": ("52.5", "41.3", "30"), "1.28e+11": ("896", "704", "512"), "1e12": ("7000", "5500", "4000")},
    16: {"7.5e9": ("35.6", "21.6", "7.5"), "1.28e+11": ("608", "368", "128"), "1e12": ("4750", "2875", "1000")},
    64: {"7.5e9": ("31.4", "16.6", "1.88"), "1.28e+11": ("536", "284", "32"), "1e12": ("4187", "2218", "250")},
    256: {"7.5e9": ("30.4", "15.4", "0.47"), "1.28e+11": ("518", "263", "8"), "1e12": ("4046", "2054", "62.5")},
    1024: {"7.5e9": ("30.1", "15.1", "0.12"), "1.28e+11": ("513", "257", "2"), "1e12": ("4011", "2013", "15.6")},
}
CELLS = [(params, nd, stage, cells[stage - 1])
         for nd, row in TABLE1.items() for params, cells in row.items() for stage in (1, 2, 3)]


@pytest.mark.parametrize("params,nd,stage,printed", CELLS)
def test_zero_table1_cell(capsys, params, nd, stage, printed):
    plan = plan_json(capsys, "--params", params, "--zero-stage", str(stage), "--data-parallel-size", str(nd),
                     "--precision", "fp16")
    ours = plan["memory"]["model_states"] / 1e9
    paper = float(printed)
    if abs(ours - paper) <= 0.005 * paper:
        return
    # One cell cannot be within 0.5%: 16 * 7.5e9 / 1024 = 0.1172 GB, which the paper prints
    # with two decimals as 0.12. It must then round to the printed digits.
    assert (params, nd, stage) == ("7.5e9", 1024, 3), (params, nd, stage, ours, paper)
    decimals = len(printed.split(".")[1])
    assert round(ours, decimals) == paper


def test_zero_stage0_and_fp32(capsys):
    plan = plan_json(capsys, "--params", "7500000000", "--zero-stage", "0", "--data-parallel-size", "64")
    assert plan["memory"]["model_states"] == 16 * 7_500_000_000
    s1 = model_state_bytes(10**9, 8, 1, "fp32")
    assert (s1["params"], s1["grads"], s1["optimizer"]) == (4 * 10**9, 4 * 10**9, 10**9)
    assert model_state_bytes(10**9, 8, 0, "bf16")["total"] == 16 * 10**9


# --- parameter counts ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_meta_counts_equal_formula(name):
    config = GPTConfig.preset(name)
    for tp in (1, 4):
        meta = parameter_counts(config, tp)
        assert meta["total"] == config.num_parameters_formula()
        assert meta["per_rank"] == rank_counts_formula(config, tp)


@pytest.mark.parametrize("name,tp", [("tiny", 3), ("gpt2-medium", 3), ("gpt2-xl", 4), ("tnlg-17b", 8)])
def test_per_rank_counts_sum_to_total(name, tp):
    config = GPTConfig.preset(name)
    meta = parameter_counts(config, tp)
    ranks, rep = meta["per_rank"], replicated_per_rank(config)
    assert all(r["replicated"] == rep for r in ranks)
    # unpadded: every real parameter once, replicated ones tp times
    assert sum(r["params_unpadded"] for r in ranks) == config.num_parameters_formula() + rep * (tp - 1)
    # with padding: the padded vocabulary rows are real memory on the last ranks
    padding = (config.padded_vocab_size(tp) - config.vocab_size) * config.hidden_size
    assert meta["total_padded"] == config.num_parameters_formula() + padding
    assert sum(r["params"] for r in ranks) == meta["total_padded"] + rep * (tp - 1)


def test_tnlg_17b_formula_matches_reference():
    # Narayanan et al. 2021, eq. 2 (docs/plan.md): 17,177,045,760 with V = 50304 and the final LayerNorm; the unpadded
    # model (V = 50257) has 47 * 4256 fewer.
    config = GPTConfig.preset("tnlg-17b")
    assert config.num_parameters_formula(vocab_size=50304) == 17_177_045_760
    assert config.num_parameters_formula() == 17_177_045_760 - 47 * 4256


# --- the T-NLG claims ------------------------------------------------------------------------
TNLG = ["--preset", "tnlg-17b", "--gpu-memory", "32GB", "--global-batch-size", "512", "--world-size", "256"]


def test_tnlg_17b_tp4_needs_zero(capsys):
    plain = plan_json(capsys, *TNLG, "--tensor-model-parallel-size", "4", "--zero-stage", "0")
    assert plain["model"]["seq_length"] == 1024
    assert plain["layout"]["dp"] == 64 and not plain["memory"]["model_states_fit"]
    assert plain["memory"]["model_states"] > 64e9  # 16 Psi, Psi = 4.3B
    zero1 = plan_json(capsys, *TNLG, "--tensor-model-parallel-size", "4", "--zero-stage", "1")
    assert zero1["memory"]["model_states_fit"] and zero1["memory"]["model_states"] < 19e9
    needed = zero1["tp_needed"]
    # plain DP: 10 is the smallest TP (uneven heads), 14 the smallest even split,
    # 16 the smallest dividing 256 GPUs -- Megatron's TP, which it cannot run for 28 heads.
    assert (needed["plain_dp_any"], needed["plain_dp_even"], needed["plain_dp_world"]) == (10, 14, 16)
    assert needed["this_stage_world"] == 4
    capsys.readouterr()
    main(["plan", *TNLG, "--tensor-model-parallel-size", "4", "--zero-stage", "0"])
    text = capsys.readouterr().out
    assert "do NOT fit" in text
    # the "which TP is needed" lines read as sentences
    assert ("  Without ZeRO (plain data parallelism), the model states alone: they fit from TP 10 (heads split "
            "unevenly), from TP 14 with the 28 heads split evenly (as Megatron requires), and from TP 16 among the "
            "sizes that divide 256 GPUs.\n") in text
    assert "dividing" not in text and "none up to" not in text


def test_preset_brings_its_recipe_layout(capsys):
    """``--preset tnlg-17b`` plans T-NLG's published recipe (TP 4 x DP 64 = 256 GPUs, ZeRO 1, global batch 512,
    fp16), flags override (it used to plan TP 1 x DP 1, ZeRO 0, batch 1: "3899.0 days")."""
    plan = plan_json(capsys, "--preset", "tnlg-17b")
    lay = plan["layout"]
    assert (lay["tp"], lay["dp"], lay["zero_stage"], lay["micro_batch"], lay["global_batch"], lay["precision"]) == \
        (4, 64, 1, 1, 512, "fp16")
    assert "tnlg-17b recipe" in lay["source"] and plan["memory"]["fits"]
    assert 5 < plan["compute"]["train_days"] < 60  # not 3899 days on one GPU
    # flags override the recipe field by field; the recipe's 256 GPUs stay unless DP or the world is given
    assert plan_json(capsys, "--preset", "tnlg-17b", "--tp", "16")["layout"]["dp"] == 16
    assert plan_json(capsys, "--preset", "tnlg-17b", "--zero-stage", "0")["layout"]["zero_stage"] == 0
    lay = plan_json(capsys, "--preset", "tnlg-17b", "--dp", "8")["layout"]
    assert (lay["tp"], lay["dp"], lay["world_size"]) == (4, 8, 32)
    assert plan_json(capsys, "--preset", "tnlg-17b", "--world-size", "1024")["layout"]["dp"] == 256
    lay = plan_json(capsys, "--preset", "megatron-8.3b")["layout"]
    assert (lay["tp"], lay["dp"], lay["zero_stage"], lay["global_batch"]) == (8, 64, 0, 512)
    lay = plan_json(capsys, "--preset", "gpt2-xl")["layout"]  # no published recipe: the plain defaults
    assert (lay["tp"], lay["dp"], lay["zero_stage"], lay["global_batch"]) == (1, 1, 0, 1) and "source" not in lay
    res = plan_json(capsys, "--preset", "tnlg-17b", "--search")  # the recipe's GPUs and batch
    assert res["gpus"] == 256 and res["global_batch"] == 512 and "recipe" in res["source"]
    err = plan_error(capsys, "--preset", "tnlg-17b", "--tp", "3")
    assert "256 GPUs of the tnlg-17b recipe" in err and "[1, 2, 4, 8, 16]" in err


def test_tnlg_17b_tp16_uneven(capsys):
    plan = plan_json(capsys, "--preset", "tnlg-17b", "--tensor-model-parallel-size", "16")
    p = plan["parameters"]
    assert p["source"].startswith("layer description")
    assert p["heads_per_rank"] == [2] * 12 + [1] * 4 and p["uneven"]
    assert p["largest_rank"]["rank"] == 0 and p["largest_rank"]["heads"] == 2
    assert p["smallest_rank"]["heads"] == 1
    assert p["largest_rank"]["params"] > p["smallest_rank"]["params"]
    assert 0 < p["imbalance_percent"] < 10
    assert plan["layout"]["megatron_can_run"] is False
    assert plan["memory"]["psi"] == p["largest_rank"]["params"]
    assert plan["compute"]["rank_imbalance_factor"] > 1
    capsys.readouterr()
    assert main(["plan", "--preset", "tnlg-17b", "--tensor-model-parallel-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "largest rank 0" in text and "smallest rank 12" in text and "2 heads x 12 ranks, 1 head x 4 ranks" in text


def test_search_tnlg_17b(capsys):
    res = plan_json(capsys, "--preset", "tnlg-17b", "--search", "--world-size", "256", "--gpu-memory", "32GB")
    rows = res["layouts"]
    assert rows and [r["tp"] for r in rows] == sorted(r["tp"] for r in rows)
    assert {r["tp"] for r in rows} <= {1, 2, 4, 8, 16}
    assert all(r["total"] <= 32e9 and r["dp"] * r["tp"] == 256 for r in rows)
    assert not any(r["tp"] == 4 and r["zero_stage"] == 0 for r in rows)
    assert any(r["tp"] == 4 and r["zero_stage"] == 1 for r in rows)
    assert all(r["uneven"] == (28 % r["tp"] != 0) for r in rows)
    assert all(512 % (r["dp"] * r["micro_batch"]) == 0 for r in rows)


def test_search_candidates_include_uneven(capsys):
    res = plan_json(capsys, "--preset", "gpt2-xl", "--search", "--world-size", "6", "--global-batch-size", "12",
                    "--gpu-memory", "80GB")
    assert {r["tp"] for r in res["layouts"]} == {1, 2, 3, 6}  # 25 heads: 2, 3, 6 are uneven
    assert {r["tp"] for r in res["layouts"] if r["uneven"]} == {2, 3, 6}


# --- the search table as printed -----------------------------------------------------------------
def search_table(capsys, *argv) -> dict:
    """Run ``tnlg plan --search`` and parse its table: {(tp, zero, recomp): [columns, ...]}."""
    capsys.readouterr()
    assert main(["plan", "--search", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["tp", "dp", "heads"])
    table = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        cols = line.split(None, 13)
        table.setdefault((int(cols[0]), int(cols[3]), cols[4]), []).append(cols)
    return table


def tnlg_largest_rank_params(tp: int) -> int:
    """tnlg-17b's largest TP rank by hand: 28 heads of 152, ffn 17024 split evenly, vocabulary padded to a
    multiple of 128 * tp and split evenly; LayerNorms, row-parallel biases, positions and the final LayerNorm
    replicated (Megatron's layout, tied embeddings)."""
    h, layers, head_dim, ffn, seq = 4256, 78, 152, 17024, 1024
    heads = -(-28 // tp)  # the largest rank's heads
    padded = -(-50257 // (128 * tp)) * 128 * tp
    qkv = 3 * heads * head_dim * (h + 1)
    attn_out = heads * head_dim * h + h
    mlp = (ffn // tp) * (h + 1) + (ffn // tp) * h + h
    per_layer = qkv + attn_out + mlp + 2 * 2 * h
    return layers * per_layer + padded // tp * h + seq * h + 2 * h


def heads_split(heads: int, tp: int) -> str:
    """28 heads at TP 8: 4 on 4 ranks and 3 on 4 -> ``4x4,3x4``."""
    q, r = divmod(heads, tp)
    return f"{q + 1}x{r},{q}x{tp - r}" if r else f"{q}x{tp}"


def test_search_table_tnlg_17b_states_heads_and_every_stage(capsys):
    """Every (TP, ZeRO stage) on 256 GPUs has a row: the fitting ones with their time, the others at their
    smallest footprint with the reason; heads and model states as computed by hand."""
    table = search_table(capsys, "--preset", "tnlg-17b", "--world-size", "256", "--gpu-memory", "32GB",
                         "--global-batch-size", "512")
    def gb(n):
        return f"{n / 1e9:,.2f}"
    for tp in (1, 2, 4, 8, 16):
        dp, psi = 256 // tp, tnlg_largest_rank_params(tp)
        for stage in range(4):
            rows = table.get((tp, stage, "off"), []) + table.get((tp, stage, "on"), [])
            assert rows, (tp, stage)
            for cols in rows:
                assert (int(cols[1]), cols[2]) == (dp, heads_split(28, tp))
                assert int(cols[5]) * int(cols[6]) * dp == 512  # micro batch x accumulation x DP
                states, acts, total = (float(c.replace(",", "")) for c in cols[7:10])
                # fp16 with fp32 master weights: 2 + 2 + 12 bytes per parameter, the 12 split over DP at
                # ZeRO 1; at 2 the gradients too (and a 16-bit shard beside the full copy), at 3 everything.
                # At 2 and 3 every tensor is split by rows, ceil(rows / DP) on the first ranks: at most
                # ceil(4256 / 256) / (4256 / 256) - 1 = 2.3% more (4256 the fewest rows above 1024)
                if stage == 0:
                    assert cols[7] == gb(16 * psi)
                elif stage == 1:
                    assert cols[7] == gb((2 + 2) * psi + 12 * psi / dp)
                else:
                    ideal = ((2 + (14 + 2) / dp) * psi if stage == 2 else 16 * psi / dp) / 1e9
                    assert round(ideal, 2) <= states <= ideal * 1.025 + 0.005
                assert abs(states + acts - total) <= 0.011
                fits = "does NOT fit" not in cols[-1]
                assert fits == (total <= 32.0), cols
                if not fits:  # shown at its smallest footprint, with the reason
                    assert (cols[4], cols[5], cols[10]) == ("on", "1", "-")
                    if states > 32:
                        assert f"model states alone {cols[7]} GB > 32.00 GB" in cols[-1]
    # T-NLG's point: at TP 4 plain DP does not fit, ZeRO 1 does; Megatron's TP 16 fits without ZeRO
    assert "does NOT fit" in table[(4, 0, "on")][0][-1] and (4, 0, "off") not in table
    assert "does NOT fit" not in table[(4, 1, "on")][0][-1]
    assert "does NOT fit" not in table[(16, 0, "off")][0][-1]


def test_search_no_layout_fits_says_why(capsys):
    """With no layout fitting, every (TP, ZeRO stage) still has its row and reason: the model states alone
    over the GPU, or how far over the GPU the smallest footprint still is."""
    argv = ["--preset", "gpt2-xl", "--world-size", "8", "--global-batch-size", "8", "--gpu-memory", "3.3GB"]
    table = search_table(capsys, *argv)
    assert sorted((tp, stage) for tp, stage, _ in table) == [(tp, s) for tp in (1, 2, 4, 8) for s in range(4)]
    reasons = set()
    for (tp, _, recomp), [cols] in table.items():
        assert cols[2] == heads_split(25, tp) and (recomp, cols[5]) == ("on", "1")
        states, total = float(cols[7]), float(cols[9])
        if states > 3.3:
            assert f"does NOT fit: model states alone {cols[7]} GB > 3.30 GB" in cols[-1]
            reasons.add("states")
        else:
            over = float(cols[-1].split("does NOT fit: ")[1].split(" GB over 3.30 GB even at micro batch 1")[0])
            assert abs(over - (total - 3.3)) <= 0.011
            reasons.add("over")
    assert reasons == {"states", "over"}
    capsys.readouterr()
    main(["plan", "--search", *argv])
    assert "No layout fits." in capsys.readouterr().out
    res = plan_json(capsys, "--search", *argv)
    assert res["layouts"] == [] and len(res["not_fitting"]) == 16
    assert all(r["total"] > 3.3e9 and r["reason"] for r in res["not_fitting"])


def test_readme_search_blocks_are_the_commands_output(capsys):
    """Each of the README's T-NLG blocks is lines of what the command named before it prints, verbatim, in
    order: 256 V100-32GB without and with pipelines, 64 H100-80GB with pipelines."""
    import os
    import re
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme[readme.index("## Planning T-NLG"):readme.index("\n## ", readme.index("## Planning T-NLG") + 3)]
    commands = list(re.finditer(r"`tnlg plan (--preset tnlg-17b --search\s[^`]*)`", section))
    assert len(commands) == 2
    for found in commands:
        start = section.index("```\n", found.end()) + 4
        block = section[start:section.index("\n```", start)]
        capsys.readouterr()
        assert main(["plan", *found.group(1).split()]) == 0
        printed = capsys.readouterr().out.splitlines()
        shown = [line for line in block.splitlines() if line]
        assert len(shown) >= 8 and any(line.startswith("fastest with a pipeline: TP ") for line in shown)
        positions = [printed.index(line) for line in shown]  # ValueError: a line the command does not print
        assert positions == sorted(positions)


# --- formulas ---------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [False, True])
def test_flops_match_reference(recompute):
    for name in ("gpt2-small", "megatron-8.3b", "tnlg-17b"):
        c = GPTConfig.preset(name)
        ours = flops_per_iteration(c, 512, recompute, 50304)
        ref = reference_flops(512, c.seq_length, c.num_layers, c.hidden_size, 50304, recompute)
        assert ours == pytest.approx(ref, rel=1e-12)
    assert rank_flops_imbalance(GPTConfig.preset("tnlg-17b"), 4) == 1.0


def test_activation_formula():
    c = GPTConfig.preset("megatron-8.3b")  # 24 heads
    s, h, a, l = c.seq_length, c.hidden_size, c.num_attention_heads, c.num_layers
    one = activation_bytes(c, 1, 2, False)
    assert one["per_layer"] == round(s * 2 * h * (34 + 5 * a * s / h))
    t4 = activation_bytes(c, 4, 2, False)
    assert t4["per_layer"] == round(s * 2 * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    rc = activation_bytes(c, 4, 2, True)
    assert rc["layers"] == 2 * s * 2 * h * l and rc["recompute_working"] == t4["per_layer"]
    # uneven: 28 heads at TP 8 -> the largest rank holds 4 heads (not 3.5)
    t = GPTConfig.preset("tnlg-17b")
    u = activation_bytes(t, 8, 1, False)
    sh = t.seq_length * t.hidden_size
    assert u["per_layer"] == round(sh * (10 + 8 * 4 / 28 + 16 / 8 + 5 * 4 * t.seq_length / t.hidden_size))


def test_help_states_formulas(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "Korthikanti" in out and "34 + 5*a*s/h" in out and "96*B*s*l*h^2" in out and "K = 12" in out


# --- parsing and errors ------------------------------------------------------------------------
def test_parse_sizes():
    assert parse_bytes("32GB") == 32 * 10**9
    assert parse_bytes("32GiB") == 32 * 2**30
    assert parse_bytes("80G") == 80 * 10**9
    assert parse_bytes("34359738368") == 34359738368
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    for bad in ("abc", "32XB", "-5GB", "0", "", "GB"):
        with pytest.raises(UserError, match="--gpu-memory"):
            parse_bytes(bad)
    assert parse_count("7.5e9") == 7_500_000_000
    assert parse_count("1.28e+11") == 128_000_000_000
    assert parse_count("1000000") == 1_000_000
    for bad in ("7.5x", "1.5", "-3", "0", "nan", "inf"):
        with pytest.raises(UserError, match="--params"):
            parse_count(bad)


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "tnlg-17b", "--tensor-model-parallel-size", "29"], "is 28"),
    (["--preset", "tnlg-17b", "--tensor-model-parallel-size", "3", "--world-size", "256"], "[1, 2, 4, 8, 16]"),
    (["--preset", "tnlg-17b", "--zero-stage", "4"], "valid stages: 0"),
    (["--params", "1e9", "--zero-stage", "-1"], "valid stages: 0"),
    (["--params", "1e9", "--gpu-memory", "32XB"], "'32XB'"),
    (["--params", "7.5x"], "'7.5x'"),
    (["--params", "1e9", "--preset", "tiny"], "--params"),
    (["--preset", "tnlg-17b", "--tp", "4", "--dp", "8", "--world-size", "256"], "DP = 64"),
    (["--preset", "tnlg-17b", "--tp", "4", "--dp", "8", "--global-batch-size", "12"], "Valid global batch sizes: 8, 16"),
    (["--preset", "no-such-model"], "valid presets"),
    (["--preset", "tiny", "--precision", "fp8"], "fp16, bf16, fp32"),
    (["--preset", "tiny", "--mfu", "1.5"], "--mfu"),
    (["--params", "1e9", "--search", "--world-size", "8"], "model shape"),
    (["--preset", "tiny", "--search"], "--world-size"),
    ([], "give a model"),
])
def test_errors(capsys, argv, needle):
    assert needle in plan_error(capsys, *argv)


def test_pretrains_precision_flags(capsys):
    """``--bf16`` / ``--fp16`` plan what ``--precision`` does (the flags ``tnlg pretrain`` takes); fp32 at
    ZeRO 0 is 16 bytes per parameter, bf16 at stage 0 too, and the two flags or a disagreeing
    ``--precision`` are refused in one paragraph."""
    base = ("--params", "1000000000", "--zero-stage", "1", "--data-parallel-size", "8")
    for flag, precision in (("--bf16", "bf16"), ("--fp16", "fp16")):
        via_flag, via_precision = plan_json(capsys, *base, flag), plan_json(capsys, *base, "--precision", precision)
        assert via_flag == via_precision
        assert via_flag["memory"]["model_states"] == model_state_bytes(10**9, 8, 1, precision)["total"]
    assert plan_json(capsys, *base)["memory"]["model_states"] == model_state_bytes(10**9, 8, 1, "fp16")["total"]
    for bad, words in (((*base, "--bf16", "--fp16"), "--bf16 and --fp16"),
                       ((*base, "--bf16", "--precision", "fp32"), "--precision says fp32")):
        assert main(["plan", *bad]) == 2
        assert words in capsys.readouterr().err


def test_every_architecture_field_of_the_model_config_is_a_plan_flag():
    """``tnlg plan`` takes the model's shape as ``tnlg pretrain`` does: a flag for every field a checkpoint
    records as architecture, under the declaration's spelling."""
    import argparse

    from tnlg.commands.plan import add_arguments
    from tnlg.config import arch_fields
    p = argparse.ArgumentParser()
    add_arguments(p)
    dests = {a.dest for a in p._actions}
    assert set(arch_fields()) <= dests, sorted(set(arch_fields()) - dests)
    for flag in ("--num-query-groups", "--group-query-attention", "--swiglu", "--normalization",
                 "--position-embedding-type", "--rotary-base", "--disable-bias-linear",
                 "--untie-embeddings-and-output-weights"):
        assert flag in p._option_string_actions, flag


def test_a_llama_from_flags_counts_what_transformers_builds(capsys):
    """A Llama-family model described by flags alone (GQA, SwiGLU, RMSNorm, rope, no biases, untied head):
    its parameter total is that of transformers' ``LlamaForCausalLM`` of the same shape (built on the meta
    device), and a bad architecture value is one paragraph naming the flag."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    ref = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        expected = sum(p.numel() for p in LlamaForCausalLM(ref).parameters())
    plan = plan_json(capsys, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                     "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "160",
                     "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
                     "--untie-embeddings-and-output-weights", "--vocab-size", "1000", "--seq-length", "128",
                     "--tp", "3")
    assert plan["parameters"]["total"] == expected
    assert "--num-query-groups must be a positive integer (or unset), got 0" in plan_error(
        capsys, "--preset", "llama-tiny", "--num-query-groups", "0")
    assert "--rotary-percent must be in (0, 1], got 0.0" in plan_error(capsys, "--preset", "llama-tiny",
                                                                        "--rotary-percent", "0")
