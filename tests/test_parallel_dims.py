"""The one parallel layout (TP x CP x DP x PP): its rank order, its refusals, and the flags every command
declares for it.

* ranks: TP innermost, then CP, DP, PP; the coordinates of every rank of a world written out here by
  counting, and the process groups built from them;
* a size that does not divide what the sizes inside it leave is one message naming the value and the valid
  sizes, which are exactly the sizes that do divide (checked by trying each);
* every command that takes a layout spells its flags as Megatron-LM does, with the short alias.
"""

from __future__ import annotations

import argparse
import itertools

import pytest

from tnlg.errors import UserError
from tnlg.layout import ParallelDims, World


def test_ranks_count_tp_fastest_then_cp_then_dp_then_pp():
    dims = ParallelDims(tp=2, cp=3, dp=2, pp=2)
    counted = [dict(tp_rank=t, cp_rank=c, dp_rank=d, pp_rank=p)
               for p, d, c, t in itertools.product(range(2), range(2), range(3), range(2))]
    assert dims.world == 24 and [dims.coordinates(r) for r in range(24)] == counted
    assert [dims.rank(tp=x["tp_rank"], cp=x["cp_rank"], dp=x["dp_rank"], pp=x["pp_rank"]) for x in counted] == \
        list(range(24))


def test_the_process_groups_are_the_ranks_that_share_all_other_coordinates():
    from tnlg.parallel.state import group_ranks
    dims = ParallelDims(tp=2, cp=2, dp=2, pp=2)
    coords = [dims.coordinates(r) for r in range(dims.world)]
    groups = {key: sorted(map(sorted, ranks)) for key, _, ranks in group_ranks(2, 2, 2, 2)}
    for key, varies in (("tp_group", "tp_rank"), ("cp_group", "cp_rank"), ("dp_group", "dp_rank"),
                        ("pp_group", "pp_rank")):
        same: dict = {}
        for r, c in enumerate(coords):
            same.setdefault(tuple(v for k, v in c.items() if k != varies), []).append(r)
        assert groups[key] == sorted(same.values()), key


@pytest.mark.parametrize("world", [1, 6, 12, 16])
def test_every_layout_of_a_world_is_accepted_and_each_refusal_lists_the_sizes_that_divide(world):
    for tp, pp, cp in itertools.product(range(1, 9), repeat=3):
        fits = world % (tp * pp * cp) == 0
        try:
            dims = ParallelDims.of(world, tp, pp, cp)
        except UserError as err:
            assert not fits, (tp, pp, cp)
            text = str(err)
            # the first size that does not fit what the sizes inside it leave is named with its value
            if world % tp:
                bad, rest = f"--tensor-model-parallel-size {tp}", world
            elif (world // tp) % pp:
                bad, rest = f"--pipeline-model-parallel-size {pp}", world // tp
            else:
                bad, rest = f"--context-parallel-size {cp}", world // (tp * pp)
            valid = [n for n in range(1, rest + 1) if rest % n == 0]
            assert text.startswith(f"{bad} does not divide the {world} processes"), text
            assert text.endswith(f": {valid}."), text
            assert "\n" not in text
        else:
            assert fits and (dims.tp, dims.pp, dims.cp) == (tp, pp, cp) and dims.world == world
    every = {(d.tp, d.cp, d.dp, d.pp) for d in ParallelDims.every(world, range(1, world + 1), range(1, world + 1))}
    assert every == {(t, c, d, p) for t, c, d, p in itertools.product(range(1, world + 1), repeat=4)
                     if t * c * d * p == world}


def test_a_data_parallel_size_that_disagrees_and_a_size_that_is_not_positive_are_one_message():
    with pytest.raises(UserError, match=r"--data-parallel-size 4 x TP 2 x CP 1 x PP 2 = 16 is not --world-size 8; "
                                        r"give one of the two or make them agree \(DP = 2\)"):
        ParallelDims.of(World.gpus(8), 2, 2, dp=4)
    for key, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                      ("cp", "--context-parallel-size")):
        with pytest.raises(UserError, match=f"^{flag} must be a positive integer, got 0.$"):
            ParallelDims.of(8, **{key: 0})
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3 does not divide the world size 8"):
        ParallelDims.of(World(8, "the world size 8", keyword=True), 3)


def test_micro_batches_per_step_and_the_pipeline_needs_one_per_stage():
    dims = ParallelDims(tp=2, cp=2, dp=2, pp=4)
    assert dims.micro_batches(16, 2) == 4  # CP ranks read the same samples: 16 / (2 x DP 2)
    with pytest.raises(UserError, match=r"--global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                                        r"data-parallel size 2 \(= 4\).*Valid global batch sizes: 4, 8, 12"):
        dims.micro_batches(6, 2)
    with pytest.raises(UserError, match=r"2 micro batch\(es\) per step .* fewer than the 4 pipeline stages.*"
                                        r"--global-batch-size 16 or more"):
        dims.pipeline_micro_batches(8, 2, "1f1b")


def test_a_global_batch_a_layout_cannot_run_offers_the_micro_batch_that_keeps_it():
    """A recipe's global batch (its loss curve) survives a change of layout where a smaller micro batch fits:
    each message offers the largest one (worked out by hand below), and none where no micro batch fits."""
    pp2 = ParallelDims(tp=1, dp=2, pp=2)  # the fine-tuning recipe (4 processes, global batch 16) at --pp 2
    with pytest.raises(UserError, match=r"1 micro batch\(es\) per step .* fewer than the 2 pipeline stages; .* Give "
                                        r"--global-batch-size 32 or more, or keep the global batch 16 with "
                                        r"--micro-batch-size 4 \(2 micro batches per step and DP rank\)\.$"):
        pp2.pipeline_micro_batches(16, 8, "1f1b")
    assert pp2.pipeline_micro_batches(16, 4, "1f1b") == 2  # (what the message offers runs)
    with pytest.raises(UserError, match=r"--global-batch-size 12 is not divisible by --micro-batch-size 4 x "
                                        r"data-parallel size 4 .*, or keep the global batch 12 with "
                                        r"--micro-batch-size 3 \(1 micro batch per step"):
        ParallelDims(tp=1, dp=4).micro_batches(12, 4)  # 12 / 4 ranks = 3 samples each: micro batch 3
    # interleaved, 4 stages, DP 1: global 20, micro 2: 10 micro batches, 10 // 4 = 2 rounds, 10 % 2 == 0 runs;
    # global 18, micro 2: 9 % 2 refused, micro 1: 18 % (18 // 4 = 4) = 2 refused too: no micro batch keeps 18
    inter = ParallelDims(tp=1, dp=1, pp=4)
    assert inter.pipeline_micro_batches(20, 2, "interleaved") == 10
    with pytest.raises(UserError, match=r"multiple of 2 .*give --global-batch-size 16 or 24\.$"):
        inter.pipeline_micro_batches(18, 2, "interleaved")
    # global 24, micro 5 on DP 1: 24 % 5; micro 4 gives 6 micro batches, 6 % (6 // 4 = 1) == 0: runs
    with pytest.raises(UserError, match=r"--micro-batch-size 4 \(6 micro batches"):
        inter.pipeline_micro_batches(24, 5, "interleaved")
    with pytest.raises(UserError) as refused:  # 2 samples cannot fill 4 stages whatever the micro batch
        inter.pipeline_micro_batches(2, 1, "1f1b")
    assert "keep the global batch" not in str(refused.value)


def _parser(command: str) -> argparse.ArgumentParser:
    import importlib
    module = {"pretrain": "pretrain_args", "eval": "eval", "generate": "generate", "plan": "plan",
              "convert": "convert", "demo": "demo"}[command]
    p = argparse.ArgumentParser(prog=f"tnlg {command}")
    importlib.import_module(f"tnlg.commands.{module}").add_arguments(p)
    return p


@pytest.mark.parametrize("command,keys", [
    ("pretrain", ("tp", "pp", "cp", "ep", "nproc")), ("eval", ("tp", "pp", "cp", "nproc")),
    ("generate", ("tp", "pp", "nproc")), ("plan", ("tp", "pp", "cp", "dp")), ("convert", ("tp", "pp")),
    ("demo", ("tp", "nproc")),
])
def test_every_command_spells_the_layout_flags_as_megatron_with_the_short_alias(command, keys):
    from tnlg.layout import FLAGS
    actions = _parser(command)._option_string_actions
    for key in keys:
        spellings = FLAGS[key]
        assert all(s in actions for s in spellings), (command, spellings)
        assert len({id(actions[s]) for s in spellings}) == 1  # one flag, two spellings
        assert actions[spellings[0]].type is int
