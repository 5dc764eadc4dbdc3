"""What every operator of a step allocates, reads, writes, computes and communicates.

:class:`StepTracker` is a ``TorchDispatchMode``: every ATen operator of the code it watches
(forward, autograd's backward, the optimizer, collectives) passes through it, on real
tensors or on fake ones (``FakeTensorMode``: shapes without memory, which is how
:mod:`tnlg.training.simulate` runs a 17B rank on a laptop). Per operator it records

* the storages it creates, alive until the last reference to them goes (weak references
  to the storage, so views, autograd's saved tensors and in-place results are counted once),
  except on the meta device (shapes without memory in a real run too: a model built there
  costs nothing until the engine materialises it, and its operators launch no kernel);
  each belongs to a *kind*: storages that existed before are counted only once
  :meth:`StepTracker.register`\\ ed (``parameters``, ``gradients``, ``master``, ``adam``),
  new ones are ``activations`` when created in a phase named ``forward*``, else ``temporaries``;
* the largest new storage per dtype (``largest_new``: how wide temporaries get);
* bytes read (its tensor inputs) and written (its outputs, or for an in-place operator the
  arguments its schema marks written; nothing for views and for ``empty``), FLOPs
  (``torch.utils.flop_counter``'s formulas: matmuls, convolutions, attention; and ``torch._grouped_mm``'s, a
  mixture of experts' matmuls), and for collectives (``c10d`` operators) the payload bytes per process group.

A storage resized in place (FSDP2 frees an unsharded parameter with ``untyped_storage().resize_(0)``
and grows it again before the all-gather's copy-out writes it; the resize itself dispatches no operator)
is counted at its current size: every sweep reads the sizes again, and an operator's output that lives
already is re-read when the operator writes it.

Phases (:meth:`StepTracker.phase`) give per phase the bytes live at the start and the peak,
by kind. Peaks are exact: the live set is swept whenever an allocation could set a new
peak. Slow (a Python call per operator): for measurements, never for timed runs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

__all__ = ["StepTracker", "Phase", "OpCost", "KINDS", "ALLOCATIONS"]

KINDS = ("parameters", "gradients", "master", "adam", "activations", "temporaries")
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}  # no data written
_ALIASES = {"detach", "alias", "lift_fresh", "_unsafe_view"}  # no data moved
_NO_DATA = {"prim", "profiler"}  # metadata queries (prim::device), record_function markers


@dataclass
class OpCost:
    """One operator: FLOPs and bytes moved, or (collectives) the payload and its group."""

    name: str
    flops: int
    bytes: int
    comm_bytes: int = 0
    group: str = ""


@dataclass
class Phase:
    """Totals of one phase of the step."""

    name: str
    live_start: dict[str, int]
    peak: int = 0
    peak_by_kind: dict[str, int] = field(default_factory=dict)
    flops: int = 0
    read: int = 0
    written: int = 0
    comm: dict[str, int] = field(default_factory=dict)
    ops: list[OpCost] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(name=self.name, live_start=dict(self.live_start), live_start_bytes=sum(self.live_start.values()),
                    peak_bytes=self.peak, peak_by_kind=dict(self.peak_by_kind), flops=self.flops,
                    read_bytes=self.read, written_bytes=self.written, comm_bytes=dict(self.comm), ops=len(self.ops))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StepTracker(TorchDispatchMode):
    """Live storages by kind, peaks per phase, traffic, FLOPs and collectives (module docstring).

    ``group_names`` maps a process group to the name reported for its collectives
    (e.g. ``{ps.tp_group: "tp", ps.dp_group: "dp"}``); others are named by their size.
    """

    def __init__(self, group_names: Optional[dict] = None):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.current: dict[str, int] = {k: 0 for k in KINDS}
        self.total = 0
        self.phases: list[Phase] = []
        self._groups = {_pg_key(g): n for g, n in (group_names or {}).items() if g is not None}
        self._phase: Optional[Phase] = None
        self._new_kind = "temporaries"
        self.largest_new: dict[torch.dtype, int] = {}  # the most elements of a new storage, per dtype
        self._in_flight: set[int] = set()  # new temporaries a real collective read (see _settle)

    # ------------------------------------------------------------------ bookkeeping
    def _sweep(self) -> None:
        for key, (ref, n, kind) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current[kind] -= n
                self.total -= n
            else:
                self._resized(key)

    def _resized(self, key: int) -> None:
        """Count a live storage at its current size (resized in place since it was counted)."""
        ref, n, kind = self.live[key]
        now = torch.UntypedStorage._new_with_weak_ptr(key).nbytes()
        if now != n:
            self.live[key] = (ref, now, kind)
            self.current[kind] += now - n
            self.total += now - n

    def _add(self, st, kind: str) -> None:
        ref = StorageWeakRef(st)
        key = ref.cdata
        old = self.live.get(key)
        if old is not None and not old[0].expired():
            if old[2] == kind:
                return
            self.current[old[2]] -= old[1]
            self.total -= old[1]
        n = st.nbytes()
        self.live[key] = (ref, n, kind)
        self.current[kind] += n
        self.total += n

    def register(self, tensors, kind: str) -> None:
        """Count the storages of ``tensors`` (a tensor or an iterable, ``None`` skipped) as ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        for t in _tensors([tensors] if isinstance(tensors, torch.Tensor) or tensors is None else list(tensors)):
            if t.device.type != "meta":
                self._add(t.untyped_storage(), kind)

    def live_by_kind(self) -> dict[str, int]:
        self._sweep()
        return dict(self.current)

    def _settle(self, limit_s: float = 0.25) -> None:
        """Wait (at most ``limit_s``) until the new temporaries that real collectives read are freed.
        gloo's worker thread wakes the caller of ``wait()`` before it drops its own reference to the
        work and the tensors in it (and dropping them needs the GIL), so right after a collective its
        input can outlive the caller's last reference for a moment: the bytes live at a phase's start
        would depend on thread scheduling (the gradient norm's two fp64 sums, counted or not under
        load). A temporary that Python code still holds costs this wait once. Fake tensors have no
        worker thread and are never waited for."""
        deadline = time.monotonic() + limit_s
        while self._in_flight:
            self._in_flight = {k for k in self._in_flight if k in self.live and not self.live[k][0].expired()}
            if not self._in_flight or time.monotonic() > deadline:
                break
            time.sleep(0.001)  # releases the GIL for the worker thread
        self._in_flight.clear()

    def _update_peak(self) -> None:
        ph = self._phase
        if ph is not None and self.total > ph.peak:
            self._sweep()  # the total may count storages freed since the last sweep
            if self.total > ph.peak:
                ph.peak, ph.peak_by_kind = self.total, dict(self.current)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Everything inside is phase ``name``; new storages are ``activations`` in a ``forward*`` phase."""
        self._settle()
        ph = Phase(name, self.live_by_kind())
        ph.peak, ph.peak_by_kind = self.total, dict(self.current)
        outer, self._phase = self._phase, ph
        self._new_kind = "activations" if name.startswith("forward") else "temporaries"
        try:
            yield ph
        finally:
            self._sweep()
            self._phase = outer
            self.phases.append(ph)

    # ------------------------------------------------------------------ the dispatch hook
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ph = self._phase
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        seen = {StorageWeakRef(t.untyped_storage()).cdata for t in inputs}
        for t in outputs:
            if t.device.type == "meta":  # shapes only: a meta-device model holds no memory
                continue
            st = t.untyped_storage()
            key = StorageWeakRef(st).cdata
            if key not in seen and key not in self.live:
                self._add(st, self._new_kind)
                self.largest_new[t.dtype] = max(self.largest_new.get(t.dtype, 0), t.numel())
            elif key in self.live and not self.live[key][0].expired():
                self._resized(key)  # written into: grown again since it was counted?
        self._update_peak()
        on_device = [t for t in inputs + outputs if t.device.type != "meta"]
        if ph is not None and (on_device or not inputs + outputs):
            self._account(ph, func, args, kwargs, out, inputs, outputs)
        return out

    def _account(self, ph: Phase, func, args, kwargs, out, inputs, outputs) -> None:
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d":
            for t in inputs:
                entry = self.live.get(StorageWeakRef(t.untyped_storage()).cdata)
                if entry is not None and entry[2] == "temporaries" and not isinstance(t, FakeTensor):
                    self._in_flight.add(StorageWeakRef(t.untyped_storage()).cdata)
            # an all-to-all's payload is what it sends, its input (its output buffer is an argument too)
            payload = _nbytes(inputs[1]) if name.startswith("alltoall") else sum(_nbytes(t) for t in inputs)
            group = self._group_of(args)
            ph.comm[group] = ph.comm.get(group, 0) + payload
            ph.ops.append(OpCost(name, 0, 0, payload, group))
            return
        if func.is_view or func.namespace in _NO_DATA or name in _ALIASES:
            return
        read = sum(_nbytes(t) for t in {id(t): t for t in inputs}.values())
        mutated = _mutated(func, args, kwargs)
        written = 0 if name in ALLOCATIONS else sum(_nbytes(t) for t in (mutated if mutated else outputs))
        flops = _flops(func, args, kwargs, out)
        ph.read += read
        ph.written += written
        ph.flops += flops
        ph.ops.append(OpCost(name, flops, read + written))

    def _group_of(self, args) -> str:
        for a in tree_leaves(args):
            if isinstance(a, torch.ScriptObject) or isinstance(a, torch.distributed.ProcessGroup):
                pg = _unbox(a)
                if pg is not None:
                    return self._groups.get(_pg_key(pg), f"group of {pg.size()}")
        return "unknown"


def _tensors(tree) -> list[torch.Tensor]:
    """The plain tensors of ``tree``: a wrapper subclass (a ``DTensor``: FSDP2's sharded parameters and
    gradients) by the tensors inside it, which hold its memory (its own storage is a full-size stand-in
    with no data)."""
    out: list[torch.Tensor] = []
    for t in tree_leaves(tree):
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += _tensors([getattr(t, n) for n in names])
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place or ``out=`` operator writes (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out += _tensors(v)
    return out


_aten = torch.ops.aten
# the CPU's flash attention takes the arguments of CUDA's (query, key, value first; backward: grad_out first)
_CPU_ALIASES = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
                _aten._scaled_dot_product_flash_attention_for_cpu_backward:
                    _aten._scaled_dot_product_flash_attention_backward}


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """``torch._grouped_mm``'s FLOPs (a mixture of experts' matmuls; ``flop_counter`` has no formula): ``2 x``
    the output's elements ``x`` the contracted size, which for two 2-D operands (groups along the contracted
    dimension: the weight gradient, ``[G, m, n]`` out) is split over the ``G`` groups."""
    assert out_val is not None
    if a.dim() == 2 and b.dim() == 2:
        return 2 * out_val.numel() * a.shape[1] // out_val.shape[0]
    return 2 * out_val.numel() * a.shape[-1]


_EXTRA_FLOPS: dict = {_aten._grouped_mm: _grouped_mm_flops}


def _flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    fn: Optional[Callable] = flop_registry.get(_CPU_ALIASES.get(packet, packet)) or _EXTRA_FLOPS.get(packet)
    if fn is None:
        return 0
    return int(fn(*args, **kwargs, out_val=out))


def _unbox(obj):
    """The ``ProcessGroup`` behind a dispatcher argument (a ``ScriptObject``), or ``None``."""
    if isinstance(obj, torch.distributed.ProcessGroup):
        return obj
    try:
        return torch.distributed.ProcessGroup.unbox(obj)
    except (RuntimeError, TypeError, AttributeError):
        return None


def _pg_key(pg) -> int:
    """A key equal for the Python ``ProcessGroup`` and its unboxed dispatcher form."""
    return hash(pg.group_name) if hasattr(pg, "group_name") else id(pg)
