"""GPT dataset: Megatron's index semantics, determinism, caching, splits, blending, masks, sampler."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tnlg.data import gpt_dataset as gd
from tnlg.data.gpt_dataset import (BlendedDataset, GPTDataset, blending_indices, build_index_arrays,
                                   build_train_valid_test_datasets, parse_data_path, parse_split, split_bounds)
from tnlg.data.indexed import IndexedDataset, IndexedDatasetBuilder
from tnlg.data.batch import Batch
from tnlg.data.sampler import MegatronPretrainingSampler
from tnlg.errors import UserError

EOD = 0


def make_corpus(folder, name="c", n_docs=60, seed=0, max_len=30, base=1):
    """Docs of random length; token = base + (doc * 37 + pos) % 997, then EOD. Returns (prefix, docs)."""
    rng = np.random.RandomState(seed)
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, f"{name}_text_document")
    docs = []
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in range(n_docs):
        n = int(rng.randint(1, max_len))
        doc = [base + (d * 37 + p) % 997 for p in range(n)] + [EOD]
        docs.append(doc)
        b.add_document(doc, [len(doc)])
    b.finalize(prefix + ".idx")
    return prefix, docs


def megatron_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's C++ build_sample_idx, transcribed (megatron/core/datasets/helpers.cpp)."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_idx_index, doc_offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[s] = (doc_idx_index, doc_offset)
    return out


@pytest.mark.parametrize("seq,num_samples", [(7, 0), (16, 200), (5, 37), (64, 90)])
def test_index_arrays_match_megatron(seq, num_samples):
    rng = np.random.RandomState(1)
    sizes = rng.randint(1, 40, size=50)
    docs = np.arange(10, 45)
    doc_idx, sample_idx, shuffle_idx = build_index_arrays(sizes, docs, seq, num_samples, seed=3)
    epochs = len(doc_idx) // len(docs)
    for e in range(epochs):  # every epoch visits every document once, in its own order
        assert sorted(doc_idx[e * len(docs):(e + 1) * len(docs)].tolist()) == docs.tolist()
    if epochs > 1:
        assert doc_idx[:len(docs)].tolist() != doc_idx[len(docs):2 * len(docs)].tolist()
    total = (epochs * int(sizes[docs].sum()) - 1) // seq
    assert len(shuffle_idx) == total >= num_samples and sorted(shuffle_idx.tolist()) == list(range(total))
    assert ((epochs - 1) * int(sizes[docs].sum()) - 1) // seq < max(num_samples, 1)  # no needless epoch
    np.testing.assert_array_equal(sample_idx, megatron_sample_idx(sizes, doc_idx, seq, total))


def test_samples_are_slices_of_the_shuffled_stream(tmp_path):
    prefix, docs = make_corpus(tmp_path)
    ds = GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=16, num_samples=100, seed=5)
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    seen = set()
    for i in range(len(ds)):
        item = ds[i]
        j = int(ds.shuffle_idx[i])
        seen.add(j)
        ref = torch.from_numpy(stream[j * 16:j * 16 + 17].astype(np.int64))
        assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32
        assert torch.equal(item["tokens"], ref[:-1]) and torch.equal(item["labels"], ref[1:])
        assert torch.equal(item["loss_mask"], torch.ones(16))
        assert set(item) == {"tokens", "labels", "loss_mask"}
    assert seen == set(range(len(ds))) and len(ds) >= 100


def test_deterministic_cached_and_rebuilt_on_change(tmp_path, monkeypatch):
    prefix, _ = make_corpus(tmp_path / "data")
    kw = dict(seq_length=8, num_samples=50, seed=1234)
    a = GPTDataset(IndexedDataset(prefix), "train", 0, 50, **kw)
    cache = tmp_path / "data" / "index-cache"
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3 and len([f for f in files if f.endswith("meta.json")]) == 1

    def boom(*a, **k):
        raise AssertionError("should have loaded the cached indices")
    monkeypatch.setattr(gd, "build_index_arrays", boom)
    b = GPTDataset(IndexedDataset(prefix), "train", 0, 50, **kw)  # loads, does not rebuild
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    monkeypatch.undo()

    # a separate copy of the data in another folder builds the same arrays from scratch
    other, _ = make_corpus(tmp_path / "copy")
    c = GPTDataset(IndexedDataset(other), "train", 0, 50, **kw)
    assert all(torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(len(a)))
    d = GPTDataset(IndexedDataset(prefix), "train", 0, 50, **dict(kw, seed=99))
    assert any(not torch.equal(a[i]["tokens"], d[i]["tokens"]) for i in range(len(a)))
    # changed settings and changed data get new index files
    GPTDataset(IndexedDataset(prefix), "train", 0, 50, **dict(kw, seq_length=9))
    assert len([f for f in os.listdir(cache) if f.endswith("meta.json")]) == 3
    make_corpus(tmp_path / "data", seed=7)  # same name, new contents
    GPTDataset(IndexedDataset(prefix), "train", 0, 50, **kw)
    assert len([f for f in os.listdir(cache) if f.endswith("meta.json")]) == 4


def test_read_only_data_folder_falls_back_to_cache_dir(tmp_path, monkeypatch):
    prefix, _ = make_corpus(tmp_path / "ro")
    real = gd._writable_dir
    monkeypatch.setattr(gd, "_writable_dir", lambda p: p.parent.name != "ro" and real(p))
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "usercache"))
    GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=8, num_samples=10, seed=1)
    assert not (tmp_path / "ro" / "index-cache").exists()
    assert len(list((tmp_path / "usercache" / "index-cache").glob("*-meta.json"))) == 1
    GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=8, num_samples=10, seed=1,
               cache_dir=tmp_path / "explicit")
    assert len(list((tmp_path / "explicit").glob("*-meta.json"))) == 1
    monkeypatch.setattr(gd, "_writable_dir", lambda p: False)
    with pytest.raises(UserError, match="--data-cache-path"):  # new settings (seq 9), nowhere to build
        GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=9, num_samples=10, seed=1)


def test_splits_and_arguments(tmp_path):
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("100,0,0") == [1.0, 0.0, 0.0] and parse_split("2/1") == pytest.approx([2 / 3, 1 / 3, 0])
    for bad in ("a,b", "1,-1,0", "0,0,0", "1,1,1,1"):
        with pytest.raises(UserError, match="--split"):
            parse_split(bad)
    assert split_bounds(parse_split("949,50,1"), 1000) == [0, 949, 999, 1000]
    assert split_bounds(parse_split("98,1,1"), 60) == [0, 58, 59, 60]  # Megatron: round each part, then shift by the excess
    assert parse_data_path(["A"]) == (["A"], None)
    assert parse_data_path("0.7 A 0.3 B") == (["A", "B"], pytest.approx([0.7, 0.3]))
    for bad in (["0.7", "A", "B"], ["x", "A", "0.3", "B"], ["0", "A", "1", "B"], []):
        with pytest.raises(UserError, match="--data-path"):
            parse_data_path(bad)
    prefix, _ = make_corpus(tmp_path)
    train, valid, test = build_train_valid_test_datasets([prefix], "80,20,0", 8, (40, 5, 5), seed=1)
    assert test is None and train.doc_end == valid.doc_begin == 48 and valid.doc_end == 60
    assert set(train.doc_idx.tolist()).isdisjoint(valid.doc_idx.tolist())
    assert len(train) >= 40 and len(valid) >= 5
    train, valid, test = build_train_valid_test_datasets([prefix], "100,0,0", 8, (10, 0, 0), seed=1)
    assert valid is None and test is None and (train.doc_begin, train.doc_end) == (0, 60)


def test_blending_weights_within_one_percent(tmp_path):
    pa, _ = make_corpus(tmp_path, "a", base=1)
    pb, _ = make_corpus(tmp_path, "b", base=1001, seed=1)
    pc, _ = make_corpus(tmp_path, "c", base=2001, seed=2)
    train, valid, _ = build_train_valid_test_datasets(["0.7", pa, "0.3", pb], "90,10,0", 4, (10000, 100, 0),
                                                      seed=2)
    assert isinstance(train, BlendedDataset) and len(train) == 10000
    frac = np.bincount(train.dataset_index, minlength=2) / 10000
    assert abs(frac[0] - 0.7) < 0.01 and abs(frac[1] - 0.3) < 0.01
    for i in range(0, 10000, 997):  # each blended sample is that member's sample, from the right corpus
        d, k = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        item = train[i]
        assert torch.equal(item["tokens"], train.datasets[d][k]["tokens"])
        nonzero = item["tokens"][item["tokens"] != EOD]
        assert bool(((nonzero > 1000) == (d == 1)).all())
    for n in (7, 100, 1000):  # every prefix stays within a sample or two of its share
        counts = np.bincount(train.dataset_index[:n], minlength=2)
        assert np.all(np.abs(counts - np.array([0.7, 0.3]) * n) <= 1.5)
    assert isinstance(valid, BlendedDataset) and len(valid) == 100
    three, _, _ = build_train_valid_test_datasets(["5", pa, "3", pb, "2", pc], "1", 4, (10000, 0, 0), seed=2)
    assert np.allclose(np.bincount(three.dataset_index) / 10000, [0.5, 0.3, 0.2], atol=0.01)
    first = three[int(np.argmax(three.dataset_index == 2))]["tokens"]
    assert bool((first[first != EOD] > 2000).all())
    idx, _ = blending_indices([0.5, 0.3, 0.2], 10000)
    assert np.array_equal(idx, three.dataset_index)


def megatron_masks(tokens, eod, reset_position_ids, reset_attention_mask):
    """Megatron's get_ltor_masks_and_position_ids for one sample (True = may attend)."""
    seq = len(tokens)
    att = torch.tril(torch.ones(seq, seq))
    pos = torch.arange(seq)
    eod_index = pos[tokens == eod].tolist()
    pos = pos.clone()
    prev = 0
    for i in eod_index:
        if reset_attention_mask:
            att[i + 1:, :i + 1] = 0
        if reset_position_ids:
            pos[i + 1:] -= i + 1 - prev
            prev = i + 1
    return att.bool(), pos


@pytest.mark.parametrize("reset_pos,reset_att", [(True, True), (True, False), (False, True)])
def test_eod_mask_and_document_resets(tmp_path, reset_pos, reset_att):
    prefix, _ = make_corpus(tmp_path, max_len=8)
    ds = GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=24, num_samples=20, seed=3, eod_id=EOD,
                    eod_mask_loss=True, reset_position_ids=reset_pos, reset_attention_mask=reset_att)
    for i in range(len(ds)):
        item = ds[i]
        assert torch.equal(item["loss_mask"], (item["labels"] != EOD).float())
        att, pos = megatron_masks(item["tokens"], EOD, reset_pos, reset_att)
        docs = item["attention_mask"]  # per-position document ids (O(s)): the mask is theirs, made causal
        assert docs.dtype == torch.int64 and docs.shape == (24,) and item["position_ids"].dtype == torch.int64
        mask = (docs[:, None] == docs[None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
        assert torch.equal(mask, att) and torch.equal(item["position_ids"], pos)
    with pytest.raises(UserError, match="eod_id"):
        GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=24, num_samples=20, seed=3,
                   reset_position_ids=True)


def test_tokens_outside_vocab_name_the_document(tmp_path):
    prefix, docs = make_corpus(tmp_path)
    biggest = max(max(d) for d in docs)
    offender = next(i for i, d in enumerate(docs) if biggest in d)
    GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=8, num_samples=10, seed=1,
               vocab_size=biggest + 1)
    with pytest.raises(UserError, match=f"document {offender} of .* holds token id {biggest}, outside the "
                                        f"vocabulary of {biggest} tokens"):
        GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=8, num_samples=10, seed=1,
                   vocab_size=biggest)


def _global_order(total, consumed, mbs, dp):
    samplers = [iter(MegatronPretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    order = []
    for steps in zip(*samplers):
        assert all(len(s) == mbs for s in steps)
        for s in steps:
            order.extend(s)
    return order


def test_sampler_order_independent_of_dp_and_resumable(tmp_path):
    for mbs, dp in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 4), (1, 4)]:
        assert _global_order(96, 0, mbs, dp) == list(range(96 - 96 % (mbs * dp)))
        for k in (5, 24, 37):  # resume at any consumed count: the same next samples
            order = _global_order(96, k, mbs, dp)
            assert order == list(range(k, k + len(order)))
    last = [list(MegatronPretrainingSampler(11, 4, 2, r, 2, drop_last=False)) for r in range(2)]
    assert last == [[[4, 5], [8, 9]], [[6, 7], [10]]]
    assert len(MegatronPretrainingSampler(11, 4, 2, 0, 2, drop_last=False)) == 2
    with pytest.raises(UserError, match="consumed_samples"):
        MegatronPretrainingSampler(10, 11, 1, 0, 1)
    # with the dataset: DP=2 reads exactly the samples DP=1 reads, in the same global order
    prefix, _ = make_corpus(tmp_path)
    ds = GPTDataset(IndexedDataset(prefix), "train", 0, 60, seq_length=8, num_samples=40, seed=1)
    one = [Batch.collate([ds[i] for i in b]).tokens for b in MegatronPretrainingSampler(len(ds), 0, 4, 0, 1)]
    loaders = [torch.utils.data.DataLoader(ds, batch_sampler=MegatronPretrainingSampler(len(ds), 0, 2, r, 2),
                                           collate_fn=Batch.collate) for r in range(2)]
    two = [torch.cat([a.tokens, b.tokens]) for a, b in zip(*loaders)]
    assert len(one) == len(two) and all(torch.equal(x, y) for x, y in zip(one, two))
    batch = Batch.collate([ds[0], ds[1]])
    assert batch.tokens.shape == (2, 8) and batch.loss_mask is not None and batch.loss_mask.dtype == torch.float32


def test_ranks_build_once_and_agree(tmp_path, monkeypatch):
    """Two "ranks" (threads) call the builder at once: with a barrier rank 0 builds and rank 1 loads;
    without one the file lock lets exactly one of them build each index."""
    import threading
    prefix, _ = make_corpus(tmp_path / "data")
    builds = []
    real = gd.build_index_arrays
    monkeypatch.setattr(gd, "build_index_arrays", lambda *a, **k: builds.append(1) or real(*a, **k))
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def rank(r, cache, use_barrier):
        try:
            train, valid, _ = build_train_valid_test_datasets(
                [prefix], "90,10,0", 8, (64, 8, 0), seed=7, cache_dir=cache,
                barrier=barrier.wait if use_barrier else None, is_builder=(r == 0))
            results[(cache, r)] = [train[i]["tokens"].tolist() for i in range(0, 64, 9)] + [valid[0]["tokens"].tolist()]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    for cache, use_barrier in ((str(tmp_path / "a"), True), (str(tmp_path / "b"), False)):
        builds.clear()
        threads = [threading.Thread(target=rank, args=(r, cache, use_barrier)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(builds) == 2  # train + valid, built once each
        assert results[(cache, 0)] == results[(cache, 1)]
        metas = sorted(Path(cache).glob("*-meta.json"))
        assert len(metas) == 2 and not list(Path(cache).glob("*.tmp-*"))
        assert json.loads(metas[0].read_text())["seq_length"] == 8
    assert results[(str(tmp_path / "a"), 0)] == results[(str(tmp_path / "b"), 0)]


def test_resumed_run_keeps_the_sample_order_at_any_length(tmp_path):
    """A run that changes --train-iters / --global-batch-size on resume (so the dataset is
    built for another number of samples, and of epochs) continues with the same order: every shorter
    build is a prefix of every longer one, growing 1 -> 2 -> 3 epochs and shrinking 3 -> 1."""
    rng = np.random.RandomState(1)
    sizes = rng.randint(1, 40, size=50)
    docs = np.arange(5, 45)
    tokens_per_epoch = int(sizes[docs].sum())
    per_epoch = (tokens_per_epoch - 1) // 16
    builds = [build_index_arrays(sizes, docs, 16, n, seed=1234) for n in (per_epoch // 2, per_epoch + 5,
                                                                          2 * per_epoch + 7)]
    assert [len(d) // len(docs) for d, _, _ in builds] == [1, 2, 3]
    for (d1, s1, sh1), (d2, s2, sh2) in [(builds[0], builds[1]), (builds[1], builds[2]), (builds[0], builds[2])]:
        np.testing.assert_array_equal(d1, d2[:len(d1)])
        np.testing.assert_array_equal(s1, s2[:len(s1)])
        np.testing.assert_array_equal(sh1, sh2[:len(sh1)])
    doc_idx, _, shuffle_idx = builds[2]
    bounds = gd.epoch_sample_bounds(tokens_per_epoch, 16, 3)
    for e in range(3):  # each epoch: every document once, and a shuffle of its own samples only
        assert sorted(doc_idx[e * len(docs):(e + 1) * len(docs)].tolist()) == docs.tolist()
        assert sorted(shuffle_idx[bounds[e]:bounds[e + 1]].tolist()) == list(range(bounds[e], bounds[e + 1]))
    assert doc_idx[:len(docs)].tolist() != doc_idx[len(docs):2 * len(docs)].tolist()

    # the same through the dataset (the seed 1234, 1 epoch vs 2): samples agree token for token
    prefix, _ = make_corpus(tmp_path / "data")
    kw = dict(seq_length=8, seed=1234, cache_dir=tmp_path / "cache")
    one = GPTDataset(IndexedDataset(prefix), "train", 0, 60, num_samples=50, **kw)
    ds = {n: GPTDataset(IndexedDataset(prefix), "train", 0, 60, num_samples=n, **kw)
          for n in (50, len(one) + 1, 2 * len(one) + 1)}
    assert [d.num_epochs for d in ds.values()] == [1, 2, 3]
    small, mid, big = ds.values()
    for shorter, longer in ((small, mid), (mid, big), (small, big)):  # grow, and read backwards: shrink
        for i in range(len(shorter)):
            assert torch.equal(shorter[i]["tokens"], longer[i]["tokens"]), (len(shorter), len(longer), i)
    # the cache is keyed by what decides the arrays: the number of epochs, not of samples
    GPTDataset(IndexedDataset(prefix), "train", 0, 60, num_samples=51, **kw)
    assert len(list((tmp_path / "cache").glob("*-meta.json"))) == 3

    # a blend of two corpora keeps its order too when the number of samples changes
    pb, _ = make_corpus(tmp_path / "data", "b", base=1001, seed=1)
    blends = [build_train_valid_test_datasets(["0.6", prefix, "0.4", pb], "100,0,0", 8, (n, 0, 0), seed=1234,
                                              cache_dir=tmp_path / "cache")[0] for n in (100, 700)]
    assert all(torch.equal(blends[0][i]["tokens"], blends[1][i]["tokens"]) for i in range(100))
