"""Reading Hugging Face folders: a folder either loads into exactly the model transformers computes from it
(logits equal to its own ``*ForCausalLM.from_pretrained`` of the same folder, random weights saved with
``save_pretrained``), or is refused in one paragraph naming what is unsupported, before anything is written
and before any worker starts."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch

from tnlg.cli import main

from .hf_reference import random_gpt2
from .llama_reference import random_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference_logits(folder, tokens):
    """transformers' own logits of the folder (its class by model_type, eager attention)."""
    kind = json.load(open(os.path.join(folder, "config.json")))["model_type"]
    model = getattr(transformers, CLASSES[kind]).from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def _tnlg_logits(folder, tokens):
    from tnlg.interop.hf import from_hf
    model = from_hf(str(folder)).eval()
    with torch.no_grad():
        return model(tokens)[..., :model.config.vocab_size]


def _assert_loads_exactly(folder, seq):
    tokens = torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_tnlg_logits(folder, tokens), _reference_logits(folder, tokens), rtol=1e-5, atol=1e-5)


def _edit_config(folder, **fields):
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    for k, v in fields.items():
        if v is ... and k in config:
            del config[k]
        elif v is not ...:
            config[k] = v
    json.dump(config, open(path, "w"))


def _assert_refused(capsys, tmp_path, folder, *words):
    out = tmp_path / f"converted-{os.path.basename(folder)}"
    capsys.readouterr()
    assert main(["convert", "--from", "hf", str(folder), "--to", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()
    return err


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Saved random models: Llama (GQA), Qwen2, GPT-2."""
    root = tmp_path_factory.mktemp("hf")
    random_llama("llama").save_pretrained(root / "llama")
    random_llama("qwen2", groups=6).save_pretrained(root / "qwen2")
    random_gpt2(100, 32, n_layer=2).save_pretrained(root / "gpt2")
    return root


def _copy(folders, name, tmp_path, new=None):
    dst = tmp_path / (new or name)
    shutil.copytree(folders / name, dst)
    return dst


# ----------------------------------------------------------------------------- loads exactly

@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_tied_config_with_a_different_lm_head_loads_untied_as_transformers_computes(folders, tmp_path, kind):
    """transformers 5 keeps a file's lm_head apart from the embedding when they differ, even if the config
    ties them; tnlg loads the same two matrices (it used to tie, dropping the file's lm_head)."""
    folder = _copy(folders, kind, tmp_path)
    if kind == "gpt2":  # saved tied: give it an lm_head of its own in the file
        from safetensors.torch import load_file, save_file
        sd = load_file(folder / "model.safetensors")
        sd["lm_head.weight"] = sd["transformer.wte.weight"] + 0.5
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_config(folder, tie_word_embeddings=True)
    _assert_loads_exactly(folder, 16)


def test_sharded_bin_and_prefixless_folders_load_exactly(folders, tmp_path):
    """The other layouts save_pretrained writes: shards behind model.safetensors.index.json, and
    pytorch_model.bin (whole and sharded); and a GPT-2 folder whose names lack 'transformer.' (OpenAI's)."""
    hf = transformers.LlamaForCausalLM.from_pretrained(folders / "llama")
    hf.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    _assert_loads_exactly(tmp_path / "shards", 16)
    torch.save(hf.state_dict(), tmp_path / "bin.pt")
    os.makedirs(tmp_path / "bin")
    shutil.copy(folders / "llama" / "config.json", tmp_path / "bin")
    shutil.move(tmp_path / "bin.pt", tmp_path / "bin" / "pytorch_model.bin")
    _assert_loads_exactly(tmp_path / "bin", 16)
    from safetensors.torch import load_file, save_file
    folder = _copy(folders, "gpt2", tmp_path, "bare")
    sd = load_file(folder / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in sd.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    _assert_loads_exactly(folder, 16)


# ----------------------------------------------------------------------------- Qwen2's sliding window

WINDOW_CASES = {  # config fields -> whether the window changes the logits of a 32-token sequence (or cannot run)
    "window 8 from layer 1": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), True),
    "layer_types naming layer 0": (dict(use_sliding_window=True, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"]), True),
    "sliding layer, no window": (dict(use_sliding_window=False, sliding_window=8,
                                      layer_types=["full_attention", "sliding_attention"]), True),
    "window off": (dict(use_sliding_window=False, sliding_window=8, max_window_layers=0), False),
    "window from layer 2 of 2": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), False),
    "window of every position": (dict(use_sliding_window=True, sliding_window=32, max_window_layers=0), False),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_qwen2_sliding_window_loads_with_transformers_logits(folders, tmp_path, capsys, case):
    """The window applies where transformers' Qwen2 applies it (layer_types, else the layers from
    max_window_layers on, with use_sliding_window): the folder loads with transformers' logits at 32 tokens;
    a layer marked sliding without a window (which transformers cannot run) is refused by name."""
    fields, applies = WINDOW_CASES[case]
    folder = _copy(folders, "qwen2", tmp_path)
    _edit_config(folder, **{"layer_types": ..., **fields})  # save_pretrained wrote the default's layer_types
    if case == "sliding layer, no window":
        _assert_refused(capsys, tmp_path, folder, "layer_types", "use_sliding_window False", "sliding_attention")
    else:
        _assert_loads_exactly(folder, 32)


def test_the_window_does_change_transformers_logits(folders, tmp_path):
    """The windows above are not inert: transformers' logits with the window differ from full attention."""
    tokens = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(1))
    full = _reference_logits(folders / "qwen2", tokens)
    folder = _copy(folders, "qwen2", tmp_path)
    _edit_config(folder, **{"layer_types": ..., **WINDOW_CASES["window 8 from layer 1"][0]})
    assert (_reference_logits(folder, tokens) - full).abs().max() > 1e-3


# ----------------------------------------------------------------------------- rope's pretraining length

# rope_parameters whose original_max_position_embeddings (16) a top-level one (64) overrides, or not (linear)
TOP_LEVEL_ROPES = {
    "yarn": (dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16), True),
    "llama3": (dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16), True),
    "linear": (dict(rope_type="linear", rope_theta=1e4, factor=4.0), False),
}


@pytest.mark.parametrize("rope", list(TOP_LEVEL_ROPES))
def test_a_top_level_original_max_position_embeddings_is_read_as_transformers_reads_it(folders, tmp_path, rope):
    """``config.json``'s top-level ``original_max_position_embeddings`` beside a yarn or llama3 rope (where
    Phi-3-style configs keep the pretraining length) is what transformers' rope computes with, before the one
    inside ``rope_parameters``; tnlg loads the folder, and the model object, with transformers' logits. Beside
    a linear rope, which reads no such length, it changes nothing in either."""
    from tnlg.interop.hf import from_hf
    parameters, applies = TOP_LEVEL_ROPES[rope]
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    inner = _copy(folders, "llama", tmp_path, "inner")
    _edit_config(inner, rope_parameters=parameters)
    folder = _copy(folders, "llama", tmp_path)
    _edit_config(folder, rope_parameters=parameters, original_max_position_embeddings=64)
    want = _reference_logits(folder, tokens)
    assert ((want - _reference_logits(inner, tokens)).abs().max() > 1e-3) == applies  # not inert where it applies
    torch.testing.assert_close(_tnlg_logits(folder, tokens), want, rtol=1e-5, atol=1e-5)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(from_hf(hf)(tokens)[..., :100], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- refused by name

def test_fields_that_change_the_model_are_refused_by_name(folders, tmp_path, capsys):
    cases = [("llama", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
              ("quantization_config", "'fp8'")),
             ("llama", dict(head_dim=16), ("another shape",)),  # (the files' heads are hidden / heads wide)
             ("qwen2", dict(head_dim=16), ("another shape",)),
             ("llama", dict(hidden_act="gelu"), ("hidden_act 'gelu'",)),
             ("gpt2", dict(activation_function="relu"), ("'relu'",))]
    for rope in ("longrope", "proportional"):
        cases.append(("llama", dict(rope_parameters={"rope_type": rope, "factor": 8.0, "rope_theta": 1e4}),
                      ("rope_parameters", repr(rope), "not supported yet")))
    cases.append(("qwen2", dict(rope_scaling={"type": "longrope", "factor": 4.0}), ("rope_scaling", "'longrope'")))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4, "original_max_position_embeddings": 16}
    cases += [("llama", dict(rope_parameters=dict(llama3, low_freq_factor=4.0, high_freq_factor=1.0)),
               ("high_freq_factor 1.0 must be greater than its low_freq_factor 4.0",)),
              ("llama", dict(rope_parameters={"rope_type": "linear", "factor": -2.0, "rope_theta": 1e4}),
               ("factor -2.0 must be a positive number",)),
              ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5}), ("partial_rotary_factor 0.5",))]
    for i, (name, fields, words) in enumerate(cases):
        folder = _copy(folders, name, tmp_path, f"{name}-{i}")
        _edit_config(folder, **fields)
        _assert_refused(capsys, tmp_path, folder, *words)


# ----------------------------------------------------------------------------- tensors read, never initialised

def test_missing_extra_and_misshapen_tensors_are_refused(folders, tmp_path, capsys):
    """transformers initialises a tensor the files lack at random; tnlg refuses, naming it. A layer more or
    less than the files hold, a vocabulary or KV-head count unlike the tensors' shapes: refused too."""
    from safetensors.torch import load_file, save_file
    folder = _copy(folders, "llama", tmp_path, "missing")
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    _assert_refused(capsys, tmp_path, folder, "model.layers.1.mlp.up_proj.weight", "at random")
    for i, (fields, words) in enumerate([
            (dict(num_hidden_layers=3), ("num_hidden_layers is 3", "layers [0, 1]")),
            (dict(num_hidden_layers=1), ("num_hidden_layers is 1",)),
            (dict(vocab_size=101), ("model.embed_tokens.weight [100, 48]", "[101, 48]")),
            (dict(num_key_value_heads=3), ("k_proj.weight [16, 48]", "[24, 48]")),
            (dict(tie_word_embeddings=False, num_attention_heads=0), ("num_attention_heads 0 must be a positive",)),
            (dict(num_hidden_layers=0), ("num_hidden_layers is 0", "positive integer")),
            (dict(rms_norm_eps="x"), ("rms_norm_eps",)),
            (dict(num_key_value_heads=4), ("num_key_value_heads 4 must divide num_attention_heads 6",))]):
        folder = _copy(folders, "llama", tmp_path, f"config-{i}")
        _edit_config(folder, **fields)
        _assert_refused(capsys, tmp_path, folder, *words)


def test_hostile_weight_files_end_in_one_paragraph(folders, tmp_path, capsys):
    """A pickle that calls os.system (refused, not run), a safetensors header claiming 2^62 bytes, an index
    naming a shard outside the folder."""
    canary = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    folder = tmp_path / "pickle"
    os.makedirs(folder)
    shutil.copy(folders / "llama" / "config.json", folder)
    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    _assert_refused(capsys, tmp_path, folder, "pytorch_model.bin", "run code", "system")
    assert not canary.exists()
    folder = _copy(folders, "llama", tmp_path, "header")
    with open(folder / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 2**62))
    _assert_refused(capsys, tmp_path, folder, "model.safetensors", str(2**62))
    folder = _copy(folders, "llama", tmp_path, "index")
    (tmp_path / "outside.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    os.remove(folder / "model.safetensors")
    names = json.loads(json.dumps(list(__import__("safetensors").safe_open(
        str(tmp_path / "outside.safetensors"), "pt").keys())))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "../outside.safetensors" for n in names}}))
    _assert_refused(capsys, tmp_path, folder, "'../outside.safetensors'", "inside the folder")


_BOMB = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
import transformers
from tnlg.errors import UserError
from tnlg.interop.hf_reader import read_hf_folder
start = time.time()  # the reading, after the imports
try:
    read_hf_folder(sys.argv[1])
except UserError as err:
    print("REFUSED", round(time.time() - start, 2), err)
"""


def test_a_layer_count_bomb_is_refused_at_once_under_a_2_gib_cap(folders, tmp_path):
    """A two-layer folder whose config claims 20,000 layers is refused from the files' names before the
    config is built (it used to build 20,000 random layers: 7.4 GB, 145 s)."""
    folder = _copy(folders, "qwen2", tmp_path)
    _edit_config(folder, num_hidden_layers=20000, layer_types=...)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    done = subprocess.run([sys.executable, "-c", _BOMB, str(folder)], capture_output=True, text=True, timeout=120,
                          env=env)
    took = time.time() - start
    assert done.returncode == 0 and "REFUSED" in done.stdout, done.stderr[-2000:]
    assert "num_hidden_layers is 20000, but the weight files hold layers [0, 1]" in done.stdout
    assert float(done.stdout.split()[1]) < 10, done.stdout
    assert took < 60


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_generate_and_eval_refuse_a_folder_before_any_worker_starts(folders, tmp_path, capsys, monkeypatch, command):
    """At `tnlg generate --tp 2` (and eval) the refusal comes from the launcher (it used to come from the
    workers, after launch and after the weights were read)."""
    import importlib
    module = importlib.import_module(f"tnlg.commands.{command}")
    monkeypatch.setattr(module, "run_command", lambda *a, **k: pytest.fail("workers were started"))
    folder = _copy(folders, "llama", tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "longrope", "factor": 8.0, "rope_theta": 1e4})
    (tmp_path / "text.txt").write_text("To be, or not to be: that is the question.\n")
    what = ["--prompt", "To be"] if command == "generate" else ["--task", "text", "--input", str(tmp_path / "text.txt")]
    capsys.readouterr()
    code = main([command, "--checkpoint", str(folder), "--tp", "2", "--tokenizer-model", "builtin", *what])
    err = capsys.readouterr().err
    assert code == 2 and "'longrope'" in err and "Traceback" not in err, err
