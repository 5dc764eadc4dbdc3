"""A tnlg checkpoint of a freshly initialised model, written in one process (TP 1, no optimizer state): the
starting point of the conversion and hostile-input tests."""

from __future__ import annotations


def fresh_checkpoint(path: str, cfg, iteration: int = 3) -> str:
    """Write ``cfg``'s seeded initial weights as a tnlg checkpoint at ``path`` (iteration ``iteration``); its
    ``iter_*`` folder."""
    from tnlg.checkpoint.files import FORMAT
    from tnlg.checkpoint.reshard import slice_full, targets_for
    from tnlg.checkpoint.saving import write_offline
    from tnlg.model import GPT
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.state import ParallelState
    full = full_state_dict(GPT(cfg), ParallelState.single())
    meta = dict(format=FORMAT, iteration=iteration, consumed_samples=0, config=cfg.to_dict(), options={}, data=None,
                tokenizer=None, layout=dict(param_dtype="float32"), optimizer=dict(present=False), schedule=None)
    layout = GPT.describe(cfg, 1)
    targets = targets_for(layout, 0)
    return write_offline(path, meta, 1, lambda r, names: ({n: slice_full(full[n], targets[n]) for n in names}, None),
                         layout=layout)
