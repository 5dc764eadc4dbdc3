"""The parallel layout of one job: TP, CP, DP and PP sizes (and virtual pipeline stages), with every check of
them and every message about them written once (torchtitan's ``ParallelDims``).

The world is ``TP x CP x DP x PP`` processes, TP innermost, then CP, then DP, then PP (megatron-core's
default order): rank ``((pp * DP + dp) * CP + cp) * TP + tp``. A size must divide what the sizes inside it
leave: TP the world, PP the world / TP, CP the world / (TP x PP); DP is what remains (given, it must agree).
``tnlg pretrain``'s options, ``tnlg eval``/``generate``'s launch, ``tnlg plan`` and
:func:`tnlg.parallel.state.init_parallel` resolve their layout here, and every command declares
``--tp/--pp/--cp/--nproc-per-node`` with :func:`add_layout_arguments` (``tnlg pretrain`` through the
fields of :class:`tnlg.options.ParallelOptions`, whose flags are :data:`FLAGS`).

Torch-free: ``--help`` and the checks before any process starts import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from .config import divisors
from .errors import UserError

__all__ = ["AXES", "EXPERT_AXES", "ParallelDims", "World", "FLAGS", "add_layout_arguments", "check_positive", "data_parallel_size",
           "check_context_sequence", "check_expert_parallel_size"]

# the axes of the layout, innermost first (the rank order): tensor, context, data and pipeline parallelism
AXES = ("tp", "cp", "dp", "pp")
# the expert axes, carved from DP x CP (megatron-core's "MoE parallel folding"; docs/moe.md): expert parallelism
# (EP consecutive DP x CP ranks of one TP rank and stage hold different experts) and expert data parallelism
# (the ranks that hold the same experts)
EXPERT_AXES = ("ep", "edp")
# every layout flag's spellings (Megatron-LM's name first, the one messages use) and keyword argument
FLAGS = dict(tp=("--tensor-model-parallel-size", "--tp"), pp=("--pipeline-model-parallel-size", "--pp"),
             cp=("--context-parallel-size", "--cp"), dp=("--data-parallel-size", "--dp"),
             ep=("--expert-model-parallel-size", "--ep"), nproc=("--nproc-per-node",))
KEYWORDS = dict(tp="tensor_parallel_size", pp="pipeline_parallel_size", cp="context_parallel_size",
                dp="data_parallel_size", vp="virtual_pipeline_stages", ep="expert_parallel_size",
                nproc="nproc_per_node")
_KIND = dict(tp="tensor-parallel", pp="pipeline-parallel", cp="context-parallel")
_GROUP = dict(tp="every tensor-parallel group", pp="every pipeline", cp="every context-parallel group")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class World:
    """The processes a layout is checked against, as messages name them: ``words`` (``"the 4 processes"``,
    ``"--world-size 8"``), their ``unit`` in lists of valid sizes, and whether sizes are named as keyword
    arguments (``tensor_parallel_size=2``: the library's :func:`~tnlg.parallel.state.init_parallel`) or
    as flags."""
    size: int
    words: str
    unit: str = "processes"
    keyword: bool = False

    @classmethod
    def processes(cls, n: int, how: str = "") -> "World":
        """``n`` processes (``how``: where they come from, e.g. ``" torchrun started"``)."""
        return cls(n, f"the {n} processes{how}")

    @classmethod
    def gpus(cls, n: int, words: Optional[str] = None) -> "World":
        """``tnlg plan``'s ``--world-size n`` GPUs."""
        return cls(n, words or f"--world-size {n}", "GPUs")

    def name(self, key: str) -> str:
        return KEYWORDS[key] if self.keyword else FLAGS[key][0]

    def said(self, key: str, value) -> str:
        return f"{KEYWORDS[key]}={value}" if self.keyword else f"{FLAGS[key][0]} {value}"


def check_positive(world: Optional[World] = None, **sizes) -> None:
    """Each of ``sizes`` (by layout key: ``tp=2``) a positive integer; else one message naming it."""
    for key, value in sizes.items():
        if not _is_int(value) or value < 1:
            name = world.name(key) if world is not None else FLAGS.get(key, (KEYWORDS[key],))[0]
            raise UserError(f"{name} must be a positive integer, got {value!r}.")


def data_parallel_size(world: Optional[int], tp, pp=1, cp=1) -> Optional[int]:
    """DP of ``tp``, ``pp``, ``cp`` on ``world`` processes; ``None`` where unknown or not a layout (a default
    that follows DP is then left to the checks, which say why)."""
    if world is None or not all(_is_int(v) and v > 0 for v in (world, tp, pp, cp)) or world % (tp * pp * cp):
        return None
    return world // (tp * pp * cp)


def check_context_sequence(cp: int, seq_length: int, what: str = "each sequence") -> None:
    """Context parallelism cuts ``what`` into ``2 x CP`` equal chunks (rank r holds chunks r and 2CP-1-r):
    ``2 CP`` must divide ``--seq-length``; one message listing the valid CP sizes otherwise."""
    if seq_length % (2 * cp):
        valid = [c for c in range(1, seq_length // 2 + 1) if seq_length % (2 * c) == 0][:12]
        raise UserError(f"--context-parallel-size {cp}: {what} is cut into 2 x {cp} = {2 * cp} equal chunks (rank r "
                        f"holds chunks r and {2 * cp - 1}-r), so 2 x CP must divide --seq-length {seq_length}. Valid "
                        f"CP sizes for {seq_length} tokens: {valid}{' ...' if len(valid) == 12 else ''}; or a "
                        f"--seq-length that is a multiple of {2 * cp}.")


def check_expert_parallel_size(ep, dp: int, cp: int = 1, where: str = "") -> None:
    """Expert parallelism carves its EP ranks from the DP x CP ranks (megatron-core's MoE parallel folding:
    an EP group is EP consecutive DP x CP ranks of one TP rank and stage), so EP must divide DP x CP; one
    message naming the valid sizes otherwise (``where``: the layout in words, e.g. ``" (TP 2 x CP 1 x DP 2 x
    PP 1 = 4)"``)."""
    n = dp * cp
    if not _is_int(ep) or ep < 1 or n % ep:
        split = f"DP {dp} x CP {cp} = {n}" if cp > 1 else f"DP {dp}"
        raise UserError(f"{FLAGS['ep'][0]} {ep!r} does not divide the data-parallel x context-parallel size "
                        f"({split}{where}): the experts are split over EP ranks carved from the DP x CP ranks "
                        f"(megatron-core's MoE parallel folding), every EP group complete. Valid expert-parallel "
                        f"sizes here: {divisors(n)}; or more processes.")


@dataclass(frozen=True)
class ParallelDims:
    """One job's layout: ``tp``, ``cp``, ``dp`` and ``pp`` sizes and ``vp`` model chunks per pipeline rank
    (the interleaved schedule's virtual stages; 1 otherwise). Build it with :meth:`of` (checks the sizes
    against a world); the constructor checks only that each size is a positive integer."""
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vp: int = 1

    def __post_init__(self):
        check_positive(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, vp=self.vp)

    @classmethod
    def of(cls, world, tp=1, pp=1, cp=1, dp=None, vp: int = 1, *, max_tp: Optional[int] = None,
           max_pp: Optional[int] = None, cp_fits: Optional[Callable[[int], bool]] = None) -> "ParallelDims":
        """The layout of ``tp``, ``pp``, ``cp`` on ``world`` (a :class:`World`, or a number of processes):
        TP must divide the world, PP the world / TP, CP the world / (TP x PP); ``dp`` (when given) must be
        what remains. One :class:`UserError` naming the bad value and the valid sizes (the model's limits:
        ``max_tp`` heads, ``max_pp`` layers, ``cp_fits`` the sequence's CP sizes) otherwise."""
        w = world if isinstance(world, World) else World.processes(world)
        check_positive(w, tp=tp, pp=pp, cp=cp, **({} if dp is None else dict(dp=dp)))
        n = w.size
        if not _is_int(n) or n < 1:
            raise UserError(f"{w.words} must be a positive number of {w.unit}, got {n!r}.")
        if n % tp:
            cls._refuse(w, "tp", tp, w.words, [t for t in divisors(n) if max_tp is None or t <= max_tp],
                        f"for {n} {w.unit}")
        rest = n // tp
        if rest % pp:
            within = w.words if tp == 1 else f"{w.words} / TP {tp} = {rest}"
            cls._refuse(w, "pp", pp, within, [p for p in divisors(rest) if max_pp is None or p <= max_pp],
                        f"at TP {tp} on {n} {w.unit}")
        rest //= pp
        if rest % cp:
            within = w.words if tp * pp == 1 else f"{w.words} / (TP {tp} x PP {pp}) = {rest}"
            cls._refuse(w, "cp", cp, within, [c for c in divisors(rest) if cp_fits is None or cp_fits(c)],
                        f"at TP {tp} x PP {pp} on {n} {w.unit}")
        dims = cls(tp=tp, cp=cp, dp=rest // cp, pp=pp, vp=vp)
        if dp is not None and dp != dims.dp:
            raise UserError(f"{w.said('dp', dp)} x TP {tp} x CP {cp} x PP {pp} = {dp * tp * cp * pp} is not "
                            f"{w.words}; give one of the two or make them agree (DP = {dims.dp}).")
        return dims

    @classmethod
    def every(cls, world: int, pps: Iterable[int] = (1,), cps: Iterable[int] = (1,),
              max_tp: Optional[int] = None) -> Iterator["ParallelDims"]:
        """Every layout of ``world`` processes with a PP of ``pps`` and a CP of ``cps`` (each dividing what is
        left) and a TP up to ``max_tp``, DP what remains: PP, then CP, then TP ascending (the planner's
        searches list them in this order)."""
        cps = tuple(cps)
        for pp in pps:
            for cp in cps:
                if world % (pp * cp):
                    continue
                for tp in divisors(world // (pp * cp)):
                    if max_tp is None or tp <= max_tp:
                        yield cls(tp=tp, cp=cp, dp=world // (pp * cp * tp), pp=pp)

    @staticmethod
    def _refuse(w: World, key: str, size: int, within: str, valid: list, where: str):
        raise UserError(f"{w.said(key, size)} does not divide {within}: {_GROUP[key]} must be complete (the world "
                        f"is TP x CP x DP x PP). Valid {_KIND[key]} sizes {where}: {valid or 'none'}.")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, axis: str) -> int:
        """The size of the named axis (:data:`AXES`)."""
        if axis not in AXES:
            raise ValueError(f"no parallel axis {axis!r}; valid: {', '.join(AXES)}.")
        return getattr(self, axis)

    @property
    def gradient_ranks(self) -> int:
        """The ranks gradients are averaged over and ZeRO partitions over: DP x CP (every CP rank holds the
        same weights and a part of each sequence)."""
        return self.dp * self.cp

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> dict:
        """``tp_rank``, ``cp_rank``, ``dp_rank``, ``pp_rank`` of a global ``rank``."""
        return dict(tp_rank=rank % self.tp, cp_rank=rank // self.tp % self.cp,
                    dp_rank=rank // (self.tp * self.cp) % self.dp, pp_rank=rank // (self.tp * self.cp * self.dp))

    def micro_batches(self, global_batch: int, micro_batch: int, schedule: Optional[str] = None) -> int:
        """Micro batches per step and DP rank, ``global / (micro x DP)``; one message when it is not whole (CP
        ranks read the same samples), offering the micro batch that keeps the global batch (``schedule``: the
        pipeline's, whose own needs that micro batch must meet too; :meth:`micro_batch_keeping`)."""
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            raise UserError(
                f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {micro_batch} x "
                f"data-parallel size {self.dp} (= {per_step}); the global batch is micro batch x DP x accumulation "
                f"steps. Valid global batch sizes: {per_step}, {2 * per_step}, {3 * per_step}, ... (try "
                f"--global-batch-size {max(1, global_batch // per_step) * per_step})"
                + self._keeping(global_batch, micro_batch, schedule) + ".")
        return global_batch // per_step

    def pipeline_micro_batches(self, global_batch: int, micro_batch: int, schedule: str) -> int:
        """:meth:`micro_batches`, and one message where the pipeline schedule cannot run them: at least one
        per stage; the interleaved schedule a multiple of ``micro batches // stages`` (torch's
        ``ScheduleInterleaved1F1B``). Each message offers the micro batch that keeps the global batch."""
        m, pp = self.micro_batches(global_batch, micro_batch, schedule), self.pp
        per_step = micro_batch * self.dp
        keep = self._keeping(global_batch, micro_batch, schedule)
        if m < pp:
            raise UserError(f"{m} micro batch(es) per step (--global-batch-size {global_batch} / (--micro-batch-size "
                            f"{micro_batch} x data-parallel size {self.dp})) is fewer than the {pp} pipeline stages; "
                            f"the schedule needs at least one micro batch per stage. Give --global-batch-size "
                            f"{pp * per_step} or more{keep}.")
        rounds = max(1, m // pp)
        if schedule == "interleaved" and m % rounds:
            raise UserError(f"the interleaved schedule needs the {m} micro batches per step to be a multiple of "
                            f"{rounds} (micro batches // stages, torch's ScheduleInterleaved1F1B); give "
                            f"--global-batch-size {rounds * pp * per_step} or {(rounds + 1) * pp * per_step}{keep}.")
        return m

    def micro_batch_keeping(self, global_batch: int, micro_batch: int, schedule: Optional[str] = None
                            ) -> Optional[int]:
        """The largest micro batch below ``micro_batch`` with which ``global_batch`` runs on this layout (whole
        micro batches per DP rank; with a pipeline ``schedule`` at least one per stage, and the interleaved
        schedule's multiple), or ``None``: what keeps a recipe's global batch (and so its loss curve) when
        the layout changes."""
        for b in range(micro_batch - 1, 0, -1):
            if global_batch % (b * self.dp):
                continue
            m = global_batch // (b * self.dp)
            if schedule is not None and self.pp > 1 and (m < self.pp or (schedule == "interleaved"
                                                                         and m % max(1, m // self.pp))):
                continue
            return b
        return None

    def _keeping(self, global_batch: int, micro_batch: int, schedule: Optional[str]) -> str:
        """``, or keep the global batch 16 with --micro-batch-size 4 (2 micro batches per step)`` (or nothing)."""
        b = self.micro_batch_keeping(global_batch, micro_batch, schedule)
        if b is None:
            return ""
        m = global_batch // (b * self.dp)
        return (f", or keep the global batch {global_batch} with --micro-batch-size {b} ({m} micro "
                f"batch{'es' if m != 1 else ''} per step and DP rank)")

    def describe(self) -> str:
        """``TP 2 x CP 1 x DP 2 x PP 1 = 4`` (with virtual stages: ``PP 2 (x 2 chunks)``)."""
        chunks = f" (x {self.vp} chunks)" if self.vp > 1 else ""
        return f"TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp}{chunks} = {self.world}"


_HELP = dict(
    tp="tensor-parallel size: the heads and MLP columns split over this many ranks (any size up to the head count)",
    pp="pipeline stages: the layers split over this many ranks",
    cp="context-parallel ranks: each sequence split into 2 x CP chunks, attention by a ring "
       "(docs/context_parallel.md)",
    dp="data-parallel size",
    ep="expert-parallel size: a mixture of experts' experts split over this many of the DP x CP ranks",
    nproc="local processes to launch unless already under torchrun (which sets the world)",
)


def add_layout_arguments(group, defaults: dict, help: Optional[dict] = None, dest: Optional[dict] = None,
                         metavar: Optional[dict] = None) -> None:
    """Declare the layout flags ``defaults`` names (keys of :data:`FLAGS`; ``argparse.SUPPRESS`` or a
    value each): Megatron-LM's spelling and its short alias, integers, the words of :data:`_HELP` followed
    by ``help[key]`` (the command's own), ``dest`` by key (default: the key, ``args.tp``)."""
    for key, default in defaults.items():
        words = "; ".join(w for w in (_HELP[key], (help or {}).get(key)) if w)
        kw: dict = dict(dest=(dest or {}).get(key, KEYWORDS[key] if key == "nproc" else key), type=int,
                        default=default, help=words)
        if metavar and key in metavar:
            kw["metavar"] = metavar[key]
        group.add_argument(*FLAGS[key], **kw)
