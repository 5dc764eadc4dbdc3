"""Converting a Hugging Face folder never holds the model: ``tnlg convert --from hf`` builds each tnlg tensor
from only the Hugging Face tensors it is made of when a shard needs it, slices the shard and lets both go.
Measured as the peak of tensor bytes newly allocated during the conversion (tnlg's own
:class:`~tnlg.plan.tracker.StepTracker`, which sees every ATen allocation; the folder's files are
memory-mapped, not allocated), against one layer's worth of float32 weights."""

from __future__ import annotations

import pytest
import torch

LAYERS = 8
DIMS = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
            max_position_embeddings=32, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A bf16 Llama folder (grouped-query attention, SwiGLU) of 8 layers of about 2 MB each in bf16 (4 MB as float32)."""
    import transformers
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=LAYERS, **DIMS)).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("hf") / "llama"
    hf.save_pretrained(path)
    layer = sum(p.numel() for n, p in hf.named_parameters() if n.startswith("model.layers.0.")) * 4  # as float32
    model = sum(p.numel() for p in hf.parameters()) * 4
    return dict(path=str(path), layer=layer, model=model)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_folder_converts_holding_about_one_layer_not_the_model(folder, tmp_path, tp):
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint
    from tnlg.plan.tracker import StepTracker
    tracker = StepTracker()
    with tracker, tracker.phase("convert"):
        hf_to_checkpoint(folder["path"], str(tmp_path / "ck"), tp_size=tp)
    peak = tracker.phases[0].peak
    # the model is 8 layers; the largest tensor is a layer's fused gate/up (about half a layer): its two float32
    # inputs, itself and one shard of it stay under 2 layers (building the whole state dict first: 13-16 layers)
    assert folder["model"] > 7 * folder["layer"]
    assert peak < 2 * folder["layer"], (peak, folder["layer"], folder["model"])
