"""The Megatron import under seeded random mutations of valid checkpoints (run as a child process by
tests/test_fuzz_megatron.py, under a memory limit).

``python tests/fuzz_megatron.py BASE WORK SEED COUNT READER...``: BASE holds a valid legacy (``legacy/``)
and ``torch_dist`` (``torch_dist/``) Megatron checkpoint. For each reader (``legacy``: the rank file;
``index``: the ``.metadata`` index; ``chunks``: the ``.distcp`` data file) COUNT mutated checkpoints are
made in WORK, one at a time (the same files for the same seed): truncations, byte flips, type swaps, deep
nesting, shared and cyclic object graphs, huge sizes, ``../`` and absolute names, globals that run code,
model choices tnlg does not compute in the args, and indexes whose keys share one record of repeated chunks.
Each is read by the importer; an outcome is good when it is a success or one :class:`UserError` paragraph
(one line, no torch advice, no allocation failure, nothing written). It is bad when anything else is
raised, when a file outside the checkpoint is opened (an audit hook watches every ``open``; a valid data
file waits outside, ``../canary.distcp``, so an escape would succeed), or when one file takes longer than
its time budget (``faulthandler`` then ends the process with every thread's stack). Output: a ``BEGIN``
line per file, ``BAD`` lines, and ``DONE reader ok refused`` per reader; the exit status is 1 on any
bad outcome.
"""

from __future__ import annotations

import copy
import faulthandler
import io
import os
import pickle
import random
import shutil
import sys
import traceback

import torch

PER_FILE_S = 20      # a file's time budget (generous: the test machine is shared)
FULL_EVERY = 20      # every N-th file is converted to a tnlg checkpoint (else read without writing)
ITER = "iter_0000003"


class Evil:
    """A pickle that runs ``os.system`` when it is loaded."""

    def __reduce__(self):
        return (os.system, ("echo fuzz-ran-code > /dev/null",))


# --------------------------------------------------------------------------- values and graphs

def deep(rng: random.Random, kind: str = "list"):
    node: object = 1
    for _ in range(rng.randint(20, 2000)):
        node = [node] if kind == "list" else {"k": node}
    return node


def shared_graph(levels: int = 40) -> dict:
    node: dict = {"leaf": torch.zeros(1)}
    for _ in range(levels):
        node = {"a": node, "b": node}
    return node


def cycle() -> dict:
    d: dict = {"w": torch.zeros(2)}
    d["self"] = d
    return d


def odd_value(rng: random.Random, canary: str):
    """A value of another type or size than the one it replaces."""
    pool = ["x", "", "two", -5, -1, 0, 1, 3, 10 ** 7, 2 ** 34, 2 ** 62, 2 ** 100, 10 ** 5000, 3.5, float("nan"),
            float("inf"), None, True, [], {}, [1, 2], (1,), b"\0\1", "../../canary.distcp", canary, "/etc/passwd"]
    pick = rng.randrange(len(pool) + 8)
    if pick < len(pool):
        return pool[pick]
    return [lambda: torch.zeros(3, dtype=torch.int64), lambda: torch.zeros(()),
            lambda: torch.ones(2, 2, dtype=torch.bool), lambda: deep(rng), lambda: deep(rng, "dict"),
            lambda: shared_graph(rng.randint(20, 40)), cycle,
            Evil][pick - len(pool)]()


# --------------------------------------------------------------------------- byte-level mutations

def mutate_bytes(data: bytes, rng: random.Random, lo: int = 0, hi: int = -1) -> tuple[bytes, str]:
    """Truncate, flip, overwrite, insert or duplicate bytes (in ``[lo, hi)`` where a place is picked)."""
    hi = len(data) if hi < 0 else hi
    b = bytearray(data)
    op = rng.choice(["truncate", "flip", "overwrite", "insert", "duplicate"])
    at = rng.randrange(lo, max(lo + 1, hi))
    if op == "truncate":
        del b[rng.randrange(0, max(1, len(b))):]
    elif op == "flip":
        for _ in range(rng.randint(1, 16)):
            b[rng.randrange(lo, max(lo + 1, hi)) % max(1, len(b))] ^= 1 << rng.randrange(8)
    elif op == "overwrite":
        n = rng.randint(1, 64)
        b[at:at + n] = bytes(rng.randrange(256) for _ in range(n))
    elif op == "insert":
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        n = rng.randint(1, 256)
        b[at:at] = b[at:at + n]
    return bytes(b), f"bytes:{op}@{at}"


def _torch_bytes(obj, old_format: bool = False) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not old_format)
    return buf.getvalue()


def _pickle_region(data: bytes) -> tuple[int, int]:
    """Where the pickle of a ``torch.save`` zip file lies (``data.pkl``), so flips hit structure more often."""
    import zipfile
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        return info.header_offset, info.header_offset + 64 + info.compress_size
    except Exception:  # noqa: BLE001 - an old-format file: anywhere
        return 0, len(data)


# --------------------------------------------------------------------------- the legacy rank file

_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size",
         "max_position_embeddings", "seq_length", "tensor_model_parallel_size", "pipeline_model_parallel_size",
         "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "consumed_train_samples", "layernorm_epsilon",
         "hidden_dropout", "tokenizer_type", "untie_embeddings_and_output_weights", "swiglu", "num_query_groups",
         "normalization", "global_batch_size", "lr", "train_iters", "lr_decay_style", "init_method_std",
         # megatron-core's model choices tnlg refuses unless at the value it models (core_fields.py)
         "layernorm_zero_centered_gamma", "apply_layernorm_1p", "window_size", "no_rope_freq", "qk_l2_norm",
         "softmax_type", "glu_linear_offset", "activation_func_clamp_value", "gated_linear_unit")
_TOP = ("iteration", "checkpoint_version", "args", "model", "optimizer", "rng_state")


def _tensor_change(t: torch.Tensor, rng: random.Random):
    return rng.choice([lambda: t.to(torch.int64), lambda: t.to(torch.bool), lambda: t.to(torch.float16),
                       lambda: t.reshape(-1), lambda: t[..., :-1] if t.dim() else t.reshape(1),
                       lambda: t.unsqueeze(0), lambda: t.t() if t.dim() == 2 else t.expand(2, *t.shape),
                       lambda: torch.zeros(0), lambda: torch.empty(2 ** 20)])()


def mutate_legacy_state(state: dict, rng: random.Random, canary: str) -> str:
    """One structural change of a rank file's state (in place); returns what it did."""
    op = rng.choice(["arg", "arg", "arg", "top", "entry", "entry", "rename", "tensor", "tensor", "nest"])
    model = state["model"]
    names = list(model)
    if op == "arg":
        name = rng.choice(_ARGS)
        if rng.random() < 0.15:
            delattr(state["args"], name) if hasattr(state["args"], name) else None
            return f"del args.{name}"
        setattr(state["args"], name, odd_value(rng, canary))
        return f"args.{name}"
    if op == "top":
        key = rng.choice(_TOP)
        if rng.random() < 0.3:
            state.pop(key, None)
            return f"del {key}"
        state[key] = odd_value(rng, canary)
        return f"top {key}"
    name = rng.choice(names)
    if op == "entry":
        model[name] = odd_value(rng, canary)
    elif op == "rename":
        new = rng.choice(["../" + name, name.replace(".0.", ".7.", 1), name + ".x", "/" + name, str(rng.random())])
        model[new] = model.pop(name)
        name = f"{name}->{new}"
    elif op == "tensor" and isinstance(model[name], torch.Tensor):
        model[name] = _tensor_change(model[name], rng)
    else:
        model[name] = rng.choice([shared_graph, cycle, lambda: deep(rng, "dict"), lambda: {"x": deep(rng)}])()
    return f"{op} {name}"


def legacy_case(base_state: dict, base_bytes: bytes, rng: random.Random, canary: str) -> tuple[bytes, str]:
    """The bytes of one mutated ``model_optim_rng.pt`` and what was done."""
    if rng.random() < 0.35:
        lo, hi = _pickle_region(base_bytes) if rng.random() < 0.6 else (0, len(base_bytes))
        return mutate_bytes(base_bytes, rng, lo, hi)
    state = copy.deepcopy(base_state)
    what = [mutate_legacy_state(state, rng, canary) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    if rng.random() < 0.1:
        state = odd_value(rng, canary)
        what = ["state swapped"]
    old = rng.random() < 0.2
    return _torch_bytes(state, old_format=old), "; ".join(what) + (" (old format)" if old else "")


# --------------------------------------------------------------------------- the torch_dist index and chunks

def _odd_size(size, rng: random.Random):
    s = list(size)
    return rng.choice([[2 ** 34, *s[1:]], [], s + [1], [-1, *s[1:]], [s[0] + 1, *s[1:]] if s else [1], "x", None,
                       [2 ** 62] * max(1, len(s)), [0] * len(s)])


def mutate_index(meta, rng: random.Random, canary: str) -> str:
    """One structural change of a ``torch.distributed.checkpoint`` Metadata (in place)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    op = rng.choice(["path", "path", "span", "size", "chunk", "chunk", "dtype", "storage", "entry", "evil", "share"])
    storage, mds = meta.storage_data, meta.state_dict_metadata
    k = rng.choice(list(storage))
    key = rng.choice([n for n, md in mds.items() if hasattr(md, "size")])
    md = mds[key]
    if op == "path":
        storage[k].relative_path = rng.choice(["../../canary.distcp", "../canary.distcp", canary, "", "sub/x.distcp",
                                               "__9_9.distcp", ".", "..", 5, None, "__0_0.distcp/"])
        return f"path of {k.fqn}: {storage[k].relative_path!r}"
    if op == "span":
        attr = rng.choice(["offset", "length"])
        value = getattr(storage[k], attr)
        setattr(storage[k], attr, rng.choice([-1, value + 1, value - 1, 2 ** 62, 0, "x", None, value * 3]))
        return f"{attr} of {k.fqn}"
    if op == "size":
        md.size = _odd_size(md.size, rng)
        return f"size of {key}: {md.size}"
    if op == "chunk":
        c = rng.choice(md.chunks)
        change = rng.choice(["shift", "shrink", "grow", "dup", "drop", "odd", "list"])
        if change in ("shift", "shrink", "grow"):
            d = rng.randrange(len(c.sizes)) if len(c.sizes) else 0
            vals = list(c.offsets if change == "shift" else c.sizes)
            if vals:
                vals[d] += rng.choice([1, -1, 2 ** 33]) if change != "shrink" else -max(1, vals[d] // 2)
            c2 = ChunkStorageMetadata(offsets=torch.Size(vals) if change == "shift" else c.offsets,
                                      sizes=c.sizes if change == "shift" else torch.Size(max(0, v) for v in vals))
            md.chunks[md.chunks.index(c)] = c2
        elif change == "dup":
            md.chunks.append(c)
        elif change == "drop":
            md.chunks.remove(c)
        elif change == "odd":
            c.offsets = odd_value(rng, canary)
        else:
            md.chunks = rng.choice([None, "x", [1], deep(rng)])
        return f"chunk {change} of {key}"
    if op == "dtype":
        md.properties.dtype = rng.choice([torch.int64, torch.bool, torch.float16, torch.uint8, "float32", None])
        return f"dtype of {key}: {md.properties.dtype}"
    if op == "storage":
        if rng.random() < 0.5:
            del storage[k]
            return f"del storage {k.fqn}"
        storage[MetadataIndex(rng.choice([key, 5, "../x"]), rng.choice([None, torch.Size([7]), "x"]))] = storage[k]
        return "storage added"
    if op == "entry":
        choice = rng.random()
        if choice < 0.3:
            del mds[key]
        elif choice < 0.6:
            mds[rng.choice([5, None, b"k", key + ".x", ""])] = mds.pop(key)
        else:
            mds[key] = odd_value(rng, canary)
        return f"entry {key}"
    if op == "share":  # many keys sharing one record whose chunk list repeats one chunk (the check stays linear)
        keys, copies = rng.choice([(3000, 3000), (200, 20000), (20000, 200)])
        md.chunks = [md.chunks[0]] * copies
        for i in range(keys):
            mds[f"{key}.shared{i}"] = md
            storage[MetadataIndex(f"{key}.shared{i}", md.chunks[0].offsets)] = storage[k]
        return f"{keys} keys share {key}'s record of {copies} equal chunks"
    meta.planner_data = Evil()
    return "code in the index"


def index_case(base_meta, base_bytes: bytes, rng: random.Random, canary: str) -> tuple[bytes, str]:
    """The bytes of one mutated ``.metadata`` and what was done."""
    if rng.random() < 0.3:
        return mutate_bytes(base_bytes, rng)
    meta = copy.deepcopy(base_meta)
    what = [mutate_index(meta, rng, canary) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    if rng.random() < 0.05:
        meta, what = odd_value(rng, canary), ["index swapped"]
    return pickle.dumps(meta), "; ".join(what)


def chunk_case(base_meta, data: bytes, rng: random.Random, canary: str) -> tuple[bytes, bytes, str]:
    """``(.metadata, .distcp)`` bytes with one chunk of the data file changed: its bytes damaged, or its
    payload replaced by another object (appended; the index points there)."""
    meta = copy.deepcopy(base_meta)
    k = rng.choice(list(meta.storage_data))
    info = meta.storage_data[k]
    if rng.random() < 0.45:
        new, what = mutate_bytes(data, rng, info.offset, info.offset + info.length)
        if len(new) != len(data) and not what.startswith("bytes:truncate"):
            new = new[:len(data)] if len(new) > len(data) else new + b"\0" * (len(data) - len(new))
        return pickle.dumps(meta), new, f"chunk {k.fqn} {what}"
    old = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]), weights_only=True)
    like = old if isinstance(old, torch.Tensor) else torch.zeros(3)
    payload_of = rng.choice([lambda: [1, 2], lambda: 7, lambda: {"a": like}, lambda: like.to(torch.int64),
                             lambda: like.reshape(-1)[:-1], lambda: like.to(torch.float16), lambda: like.to(torch.bool),
                             lambda: like.unsqueeze(0), lambda: torch.zeros(0), lambda: Evil(), lambda: deep(rng),
                             lambda: shared_graph(), lambda: cycle(), lambda: torch.zeros(2 ** 16)])
    obj = payload_of()
    payload = _torch_bytes(obj, old_format=rng.random() < 0.2)
    info.offset, info.length = len(data), len(payload)
    return pickle.dumps(meta), data + payload, f"chunk {k.fqn} holds {type(obj).__name__}"


# --------------------------------------------------------------------------- the child's loop

class Watch:
    """An audit hook that records every file opened outside the allowed folders while ``on``."""

    def __init__(self, allowed: list[str]):
        self.allowed = [os.path.realpath(a) + os.sep for a in allowed]
        self.imports = [os.path.realpath(p) + os.sep for p in sys.path if p and os.path.isdir(p)]
        # the interpreter's bytecode cache when the environment puts it apart (PYTHONPYCACHEPREFIX): a lazy
        # import reads and writes there (a temporary name, then the .pyc)
        self.bytecode = os.path.realpath(sys.pycache_prefix) + os.sep if sys.pycache_prefix else None
        self.on, self.outside = False, []
        sys.addaudithook(self)

    def __call__(self, event: str, args) -> None:
        if not self.on or event != "open" or not isinstance(args[0], (str, bytes)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(("/proc/", "/dev/", "/sys/")) or any((path + os.sep).startswith(a) for a in self.allowed):
            return
        if path.endswith((".py", ".pyc", ".so")) and any(path.startswith(p) for p in self.imports):
            return  # a lazy import
        if self.bytecode and path.startswith(self.bytecode):
            return  # a lazy import's bytecode
        self.outside.append(path)


def check_outcome(convert, src: str, dst: str, watch: Watch) -> tuple[str, str]:
    """``("ok" | "refused" | "bad", detail)`` of reading ``src`` (``convert``: into ``dst``)."""
    from tnlg.errors import UserError
    from tnlg.interop.megatron.importer import megatron_to_checkpoint
    watch.outside.clear()
    watch.on = True
    try:
        if convert:
            megatron_to_checkpoint(src, dst)
        else:
            read_all(src)
        outcome, detail = "ok", ""
    except UserError as exc:
        msg = str(exc)
        outcome, detail = "refused", msg
        for bad in ("\n", "weights_only", "MemoryError", "can't allocate", "RecursionError", "Traceback"):
            if bad in msg:
                outcome, detail = "bad", f"the paragraph holds {bad!r}: {msg[:600]}"
        if os.path.lexists(dst):
            outcome, detail = "bad", f"a refused conversion left {sorted(os.listdir(dst))} in {dst}: {msg[:300]}"
    except BaseException:  # noqa: BLE001 - what the fuzz test looks for
        outcome, detail = "bad", traceback.format_exc()[-3000:]
    finally:
        watch.on = False
    if watch.outside:
        outcome, detail = "bad", f"opened outside the checkpoint: {watch.outside[:3]}"
    shutil.rmtree(dst, ignore_errors=True)
    return outcome, detail


def read_all(src: str) -> None:
    """What a conversion reads, without writing: the args, the index or rank files, every tensor."""
    from tnlg.interop.megatron.importer import _check_tensors, _roles, open_megatron
    source, cfg, common = open_megatron(src)
    _check_tensors(source, cfg)
    _ = source.dtype
    for role, layer, stage in _roles(cfg, source.layout.pp - 1):
        source.tensor(role, layer, stage)


def _files(root: str) -> dict:
    out = {}
    for folder, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(folder, n), "rb") as f:
                out[os.path.relpath(os.path.join(folder, n), root)] = f.read()
    return out


def _restore(root: str, files: dict) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)


def _cases(reader: str, base: str, canary: str):
    """``make(rng) -> ({relative path: bytes}, what)``: one mutated checkpoint's changed files."""
    fmt = "legacy" if reader == "legacy" else "torch_dist"
    files = _files(os.path.join(base, fmt))
    if reader == "legacy":
        rel = os.path.join(ITER, "mp_rank_00", "model_optim_rng.pt")
        state = torch.load(io.BytesIO(files[rel]), weights_only=False)
        return fmt, files, lambda rng: (lambda b, w: ({rel: b}, w))(*legacy_case(state, files[rel], rng, canary))
    index, data = os.path.join(ITER, ".metadata"), os.path.join(ITER, "__0_0.distcp")
    meta = pickle.loads(files[index])  # the fixture's own index
    if reader == "index":
        return fmt, files, lambda rng: (lambda b, w: ({index: b}, w))(*index_case(meta, files[index], rng, canary))
    return fmt, files, lambda rng: (lambda m, d, w: ({index: m, data: d}, w))(*chunk_case(meta, files[data], rng,
                                                                                             canary))


def run(base: str, work: str, seed: int, count: int, readers: list[str]) -> int:
    torch.set_num_threads(1)
    sys.setrecursionlimit(20000)  # to pickle the deep structures (loading them must not need it)
    canary = os.path.join(work, "canary.distcp")
    shutil.copy(os.path.join(base, "torch_dist", ITER, "__0_0.distcp"), canary)  # an escape would succeed
    src, dst = os.path.join(work, "ckpt"), os.path.join(work, "out")
    watch = Watch([src, dst])
    bad = 0
    for reader in readers:
        fmt, files, make = _cases(reader, base, canary)
        _restore(src, files)
        check_outcome(True, src, dst, watch)  # warm-up: every lazy import done
        counts = {"ok": 0, "refused": 0, "bad": 0}
        for i in range(count):
            rng = random.Random(f"{seed}-{reader}-{i}")
            try:
                changed, what = make(rng)
            except (RecursionError, TypeError, ValueError, AttributeError, IndexError, KeyError,
                    pickle.PicklingError) as exc:  # a mutation that does not apply to this file
                changed, what = {}, f"(no mutation: {type(exc).__name__})"
            _restore(src, files)
            for rel, data in changed.items():
                with open(os.path.join(src, rel), "wb") as f:
                    f.write(data)
            print(f"BEGIN {reader} {i} {what}", flush=True)
            convert = i % FULL_EVERY == 0 or what.startswith(("args.", "top ", "del "))
            faulthandler.dump_traceback_later(PER_FILE_S, exit=True)
            outcome, detail = check_outcome(convert, src, dst, watch)
            faulthandler.cancel_dump_traceback_later()
            counts[outcome] += 1
            if outcome == "bad":
                bad += 1
                print(f"BAD {reader} {i} ({what}): " + detail.replace("\n", " | "), flush=True)
        print(f"DONE {reader} ok={counts['ok']} refused={counts['refused']} bad={counts['bad']}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]))
