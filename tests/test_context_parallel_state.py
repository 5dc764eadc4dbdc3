"""The TP x CP x DP x PP layout against megatron-core's own rank generator (order ``tp-cp-ep-dp-pp``),
and a live 8-rank state whose groups, ranks and gradient state agree with it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tnlg.parallel.state import ParallelState, _check_layout, group_ranks
from .pool import run_distributed

LAYOUTS = [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (2, 2, 2, 1), (1, 2, 2, 2), (2, 4, 1, 2), (1, 1, 2, 2)]


def _megatron(tp, cp, dp, pp):
    from megatron.core.parallel_state import RankGenerator
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    return {"tp_group": gen.get_ranks("tp"), "cp_group": gen.get_ranks("cp"), "dp_group": gen.get_ranks("dp"),
            "pp_group": gen.get_ranks("pp"), "dp_cp_group": gen.get_ranks("dp-cp")}


@pytest.mark.needs_package("megatron.core")
@pytest.mark.parametrize("tp,cp,dp,pp", LAYOUTS)
def test_groups_are_megatron_cores(tp, cp, dp, pp):
    ours = {key: sorted(map(sorted, ranks)) for key, _, ranks in group_ranks(tp, dp, pp, cp)}
    for key, ranks in _megatron(tp, cp, dp, pp).items():
        if key in ours:
            assert ours[key] == sorted(map(sorted, ranks)), key
    assert ("cp_group" in ours) == (cp > 1)


def test_cp_1_creates_the_groups_it_created_before():
    assert [k for k, _, _ in group_ranks(2, 2, 2, 1)] == ["tp_group", "dp_group", "pp_group", "embedding_group"]


def test_a_cp_that_does_not_divide_the_rest_of_the_world_is_refused():
    with pytest.raises(ValueError, match=r"context_parallel_size=3 does not divide .* = 4.*\[1, 2, 4\]"):
        _check_layout(8, 2, 1, 3)


def _live(_ps):
    from tnlg.parallel.state import init_parallel
    ps = init_parallel(tensor_parallel_size=2, context_parallel_size=2)
    grads = ps.for_gradients()
    return dict(rank=ps.rank, world=ps.world_size, tp=ps.tp_rank, cp=ps.cp_rank, dp=ps.dp_rank,
                cp_ranks=dist.get_process_group_ranks(ps.cp_group),
                dp_ranks=dist.get_process_group_ranks(ps.dp_group),
                grad_ranks=dist.get_process_group_ranks(grads.dp_group), grad_dp=(grads.dp_rank, grads.dp_size),
                grad_rank=grads.rank, grad_group_rank=dist.get_rank(grads.dp_group),
                by_name={axis: (ps.rank_in(axis), ps.size(axis), dist.get_process_group_ranks(ps.group(axis)))
                         for axis in ("tp", "cp", "dp", "dp_cp")})


@pytest.mark.slow
@pytest.mark.needs_package("megatron.core")
def test_a_live_state_at_tp2_cp2_dp2():
    mega = _megatron(2, 2, 2, 1)
    for r, got in enumerate(run_distributed(_live, 8, 1, timeout_s=120)):
        assert got["rank"] == got["grad_rank"] == r and got["world"] == 8
        assert (got["tp"], got["cp"], got["dp"]) == (r % 2, r // 2 % 2, r // 4)
        assert got["cp_ranks"] in mega["cp_group"] and got["dp_ranks"] in mega["dp_group"]
        assert got["grad_ranks"] in mega["dp_cp_group"]
        # the groups by axis name: the same ranks as megatron-core's groups of that name, this rank's place in them
        for axis, (rank, size, ranks) in got["by_name"].items():
            assert ranks in mega[axis + "_group"] and len(ranks) == size and ranks[rank] == r, axis
        assert got["grad_dp"] == (got["dp"] * 2 + got["cp"], 4) and got["grad_group_rank"] == got["grad_dp"][0]


def test_the_gradient_state_is_the_state_itself_at_cp_1():
    ps = ParallelState(tp_size=2, dp_size=2)
    assert ps.for_gradients() is ps


def test_named_axes_of_a_virtual_state_and_the_gradient_kinds():
    ps = ParallelState.for_virtual_rank(4, 1, dp_size=2, dp_rank=1)
    assert [(ps.size(a), ps.rank_in(a)) for a in ("tp", "dp", "cp", "pp", "dp_cp")] == \
        [(4, 1), (2, 1), (1, 0), (1, 0), (2, 1)]
    assert ps.for_gradients("dense") is ps  # (at CP 1 the dense gradients' group is DP's)
    # without expert parallelism the expert axes are EP 1 inside DP x CP, and the experts' gradients go over DP
    assert [(ps.size(a), ps.rank_in(a)) for a in ("ep", "edp")] == [(1, 0), (2, 1)]
    assert ps.for_gradients("expert") is ps
    with pytest.raises(ValueError, match="no parallel axis 'xp'; valid: tp, cp, dp, pp"):
        ps.size("xp")
    with pytest.raises(ValueError, match="kind 'adapter'; valid: dense, expert"):
        ps.for_gradients("adapter")
