"""Published training recipes of the presets: what ``tnlg pretrain --preset`` and ``tnlg plan --preset``
take from them (batch, schedule, precision, layout) when the flags do not say otherwise."""

from __future__ import annotations

__all__ = ["RECIPES"]

# Published recipes: T-NLG as reported (Microsoft 2020); Megatron 8.3B's (Shoeybi et al. 2019).
RECIPES = {
    "tnlg-17b": dict(global_batch_size=512, micro_batch_size=1, train_iters=300_000, lr=1.5e-4, min_lr=1e-5,
                     lr_warmup_iters=3200, lr_decay_iters=500_000, lr_decay_style="cosine", weight_decay=0.01,
                     clip_grad=1.0, fp16=True, tensor_model_parallel_size=4, zero_stage=1,
                     hidden_dropout=0.1, attention_dropout=0.1),
    "megatron-8.3b": dict(global_batch_size=512, micro_batch_size=1, train_iters=300_000, lr=1.5e-4,
                          min_lr=1e-5, lr_warmup_iters=3000, lr_decay_style="cosine", weight_decay=0.01,
                          clip_grad=1.0, fp16=True, tensor_model_parallel_size=8, zero_stage=0,
                          hidden_dropout=0.1, attention_dropout=0.1),
}
