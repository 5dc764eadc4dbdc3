"""Fine-tuning data: prompt/completion and chat rows become samples whose token layout is built here
independently from the tokenizer itself; packed sequences keep samples apart (a packed sample's logits
and per-token loss equal the sample run alone, on the real model, with rope and learned positions);
the loss mask counts exactly the completion and the end-of-document id; truncation, skips, chat
templates (an HF folder's, with and without generation blocks, and the built-in one) and every bad
input's paragraph."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tnlg.data.sft import build_sft_datasets, pack
from tnlg.data.tokenizer import Tokenizer, load_tokenizer
from tnlg.errors import UserError

SEQ = 48
PAIRS = [("What is the capital of France?", "Paris."), ("2 + 2 =", " 4, as everyone knows"),
         ("Translate 'cat' to German:", "Katze"), ("Say hello", "hello there, friend, how are you today?"),
         ("", "an empty prompt is allowed"), ("Short", "x")]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def gpt2_tok(tmp_path_factory):
    """A tiny GPT-2 byte-level BPE folder (the byte alphabet, a few merges, <|endoftext|>)."""
    pytest.importorskip("tokenizers")
    from tests.hf_reference import bytes_to_unicode
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("an", "d"), ("Ġ", "and")]
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    d = tmp_path_factory.mktemp("gpt2")
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return load_tokenizer(str(d))


@pytest.fixture(params=["sentencepiece", "gpt2bpe"])
def any_tok(request, tok):
    return tok if request.param == "sentencepiece" else request.getfixturevalue("gpt2_tok")


def _jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _pc(pairs, key="completion"):
    return [{"prompt": p, key: c} for p, c in pairs]


def _build(path, tok, seq=SEQ, **kw):
    kw.setdefault("train_samples", 1)
    kw.setdefault("valid_samples", 0)
    kw.setdefault("seed", 0)
    return build_sft_datasets(str(path), None, tok, seq, **kw)


def _expected_sample(tok, prompt, completion):
    """Independent construction: the tokenizer's ids of each text, the end-of-document id last."""
    p, c = tok.encode(prompt), tok.encode(completion)
    return p + c + [tok.eod_id], [0] * len(p) + [1] * (len(c) + 1)


def _expected_item(samples, seq, pad):
    """The item of ``samples`` (ids, counted) packed in order, built position by position."""
    tokens, labels, mask, pos, doc = [], [], [], [], []
    for k, (ids, counted) in enumerate(samples):
        for j, t in enumerate(ids):
            tokens.append(t)
            labels.append(ids[j + 1] if j + 1 < len(ids) else None)
            mask.append(counted[j + 1] if j + 1 < len(ids) else 0)
            pos.append(j)
            doc.append(k)
    n = len(tokens)
    stream = tokens + [pad] * (seq + 1 - n)
    labels = [(stream + [pad])[i + 1] if lab is None else lab for i, lab in enumerate(labels)] + [pad] * (seq + 1 - n)
    mask += [0] * (seq + 1 - n)
    pos += list(range(seq + 1 - n))
    doc += [-1] * (seq + 1 - n)
    att = [[doc[i] == doc[j] and j <= i for j in range(seq)] for i in range(seq)]
    return dict(tokens=stream[:seq], labels=labels[:seq], loss_mask=mask[:seq], position_ids=pos[:seq],
                attention_mask=att)


def _as_lists(item):
    """An item's fields as lists, its document ids ``[s]`` (O(s)) as the block-causal mask they stand for."""
    out = {k: v.tolist() for k, v in item.items()}
    docs = item["attention_mask"]
    assert docs.dtype == torch.int64 and docs.dim() == 1
    out["attention_mask"] = ((docs[:, None] == docs[None, :]) & torch.ones(len(docs), len(docs), dtype=torch.bool)
                             .tril()).tolist()
    return out


def _all_items(ds, count):
    return [ds[i] for i in range(count)]


# ----------------------------------------------------------------------------------- token layout

def test_unpacked_items_are_the_tokenizers_ids_with_the_completion_counted(tmp_path, tok):
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS[:3], "response"))
    ds, _, report = _build(path, tok, packing=False, train_samples=3)
    items = sorted((_as_lists(ds[i]) for i in range(3)), key=lambda it: it["tokens"])
    want = sorted((_expected_item([_expected_sample(tok, p, c)], SEQ, tok.eod_id) for p, c in PAIRS[:3]),
                  key=lambda it: it["tokens"])
    assert items == want
    assert report.line() == (f"3 samples into 3 sequences, {sum(len(tok.encode(c)) + 1 for _, c in PAIRS[:3])} "
                             "counted tokens, 0 truncated, 0 skipped")
    for it in items:  # the padding: never counted, its own block
        n = sum(1 for x in it["position_ids"] if x == 0)
        assert n == 2 and it["loss_mask"][-1] == 0


def test_packed_sequence_layout_and_first_fit(tmp_path, tok):
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    ds, _, report = _build(path, tok, train_samples=50, seed=3)
    samples = [_expected_sample(tok, p, c) for p, c in PAIRS]
    lengths = [len(s[0]) for s in samples]
    bins, room = [], []  # first fit, in order, written out plainly
    for k, n in enumerate(lengths):
        b = next((i for i, r in enumerate(room) if r >= n), None)
        if b is None:
            bins.append([])
            room.append(SEQ + 1)
            b = len(bins) - 1
        bins[b].append(k)
        room[b] -= n
    assert len(bins) < len(PAIRS) and any(len(b) > 1 for b in bins)  # the test does pack
    want = sorted((_expected_item([samples[k] for k in b], SEQ, tok.eod_id) for b in bins),
                  key=lambda it: it["tokens"])
    items = [_as_lists(it) for it in _all_items(ds, 50)]
    assert sorted(items[:len(bins)], key=lambda it: it["tokens"]) == want  # one epoch: each sequence once
    assert report.sequences == len(bins) and report.samples == len(PAIRS)
    assert report.counted_tokens == sum(sum(c[1:]) for _, c in samples)  # a first token is no target
    for e in range(1, 50 // len(bins)):  # every epoch is each sequence once, in its own order
        epoch = items[e * len(bins):(e + 1) * len(bins)]
        assert sorted(epoch, key=lambda it: it["tokens"]) == want
    orders = [[it["tokens"] for it in items[e * len(bins):(e + 1) * len(bins)]] for e in range(4)]
    assert len({str(o) for o in orders}) > 1
    again, _, _ = _build(path, tok, train_samples=50, seed=3)
    assert all(torch.equal(again[i]["tokens"], ds[i]["tokens"]) for i in range(50))


def test_context_parallel_reads_each_packed_sample_as_a_document(tmp_path, tok):
    from tnlg.parallel.context import document_ids
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    ds, _, report = _build(path, tok, train_samples=len(PAIRS))
    for it in _all_items(ds, report.sequences):
        pos = it["position_ids"].tolist()
        starts = [p - pos[p] for p in range(SEQ)]  # where each position's sample (or the padding) starts
        assert document_ids(it["attention_mask"]).tolist() == [starts]


def test_pack_is_first_fit_in_order():
    assert pack([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    assert pack([8, 1, 8], 8) == [[0], [1], [2]]
    assert pack([3, 3], 8, packing=False) == [[0], [1]]


def test_loss_mask_counts_exactly_the_completion_and_eod(tmp_path, tok):
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    ds, _, _ = _build(path, tok, train_samples=len(PAIRS), packing=False)
    got = sorted(it["labels"][it["loss_mask"] > 0].tolist() for it in _all_items(ds, len(PAIRS)))
    # the completion and eod; with an empty prompt the completion's first token has nothing to be predicted from
    assert got == sorted((tok.encode(c) + [tok.eod_id])[0 if tok.encode(p) else 1:] for p, c in PAIRS)
    ds2, _, rep2 = _build(path, tok, train_samples=len(PAIRS), packing=False, loss_on_prompt=True)
    got = sorted(it["labels"][it["loss_mask"] > 0].tolist() for it in _all_items(ds2, len(PAIRS)))
    assert got == sorted((tok.encode(p) + tok.encode(c) + [tok.eod_id])[1:] for p, c in PAIRS)
    assert rep2.counted_tokens == sum(len(x) for x in got)


def test_truncated_and_skipped_samples_are_counted(tmp_path, tok):
    long_prompt = "word " * 40
    rows = _pc([("Q", "a " * 60), (long_prompt, "answer"), ("Q", "fine")])
    path = _jsonl(tmp_path / "a.jsonl", rows)
    seq = 16
    assert len(tok.encode(long_prompt)) >= seq + 1 and len(tok.encode("a " * 60)) > seq
    ds, _, report = _build(path, tok, seq=seq, train_samples=2, packing=False)
    assert (report.samples, report.sequences, report.truncated, report.skipped) == (3, 2, 1, 1)
    ids, counted = _expected_sample(tok, "Q", "a " * 60)
    want = _expected_item([(ids[:seq + 1], counted[:seq + 1])], seq, tok.eod_id)
    assert _as_lists(ds[0]) == want or _as_lists(ds[1]) == want
    assert report.counted_tokens == sum(counted[1:seq + 1]) + len(tok.encode("fine")) + 1


# ----------------------------------------------------------------------------------- the model

def _model(position):
    from tnlg import GPT, GPTConfig
    torch.manual_seed(0)
    extra = dict(normalization="RMSNorm", swiglu=True) if position == "rope" else {}
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=4096 + 64,
                    position_embedding_type=position, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    return GPT(cfg).eval()


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_packed_samples_give_the_logits_of_each_sample_alone(tmp_path, tok, position):
    model = _model(position)
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    ds, _, report = _build(path, tok, train_samples=len(PAIRS))
    alone = {}
    for p, c in PAIRS:
        ids, _ = _expected_sample(tok, p, c)
        with torch.no_grad():
            alone[tuple(ids)] = model(torch.tensor([ids]))[0]  # the sample alone: no mask, default positions
    seen = 0
    for it in _all_items(ds, report.sequences):
        with torch.no_grad():
            logits = model(it["tokens"][None], position_ids=it["position_ids"][None],
                           attention_mask=it["attention_mask"][None])[0]
        starts = (it["position_ids"] == 0).nonzero().flatten().tolist() + [SEQ]
        for a, b in zip(starts, starts[1:]):
            if it["loss_mask"][a:b].sum() == 0:
                continue  # the padding
            key = tuple(it["tokens"][a:b].tolist())
            ref = alone[key] if key in alone else alone[key + (tok.eod_id,)]  # a last eod is only a label
            torch.testing.assert_close(logits[a:b], ref[:b - a], rtol=0, atol=1e-6)
            seen += 1
    assert seen == len(PAIRS) and report.sequences < len(PAIRS)


def _per_token_loss_and_grads(model, items):
    """Sum of the counted token losses over all ``items`` (one batch) / their count, and its gradients."""
    model.zero_grad()
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    logits = model(batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
    losses = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    count = batch["loss_mask"].sum()
    loss = (losses * batch["loss_mask"].flatten()).sum() / count
    loss.backward()
    return float(loss.detach()), int(count), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_packed_and_unpacked_take_the_same_per_token_loss_and_gradients(tmp_path, tok, position):
    model = _model(position).train()  # no dropout in the tiny config
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    packed, _, report = _build(path, tok, train_samples=len(PAIRS))
    unpacked, _, unpacked_report = _build(path, tok, packing=False, train_samples=len(PAIRS))
    assert report.sequences < unpacked_report.sequences == len(PAIRS)
    loss_p, count_p, grads_p = _per_token_loss_and_grads(model, _all_items(packed, report.sequences))
    loss_u, count_u, grads_u = _per_token_loss_and_grads(model, _all_items(unpacked, len(PAIRS)))
    assert count_p == count_u == report.counted_tokens
    assert abs(loss_p - loss_u) < 1e-6
    for name, g in grads_u.items():
        torch.testing.assert_close(grads_p[name], g, rtol=0, atol=1e-6, msg=name)




# ----------------------------------------------------------------------------------- chat templates

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Goodbye."}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}[A] {% generation %}{{ m['content'] }}"
              "{{ eos_token }}{% endgeneration %}{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}[A] {% endif %}")


def _only_item(path, tok, **kw):
    ds, _, report = _build(path, tok, packing=False, **kw)
    return ds[0], report


def _check_layout(it, segments, tok, seq):
    """``segments``: (text or None for the eod, counted) written out by the test."""
    ids, counted = [], []
    for text, c in segments:
        part = [tok.eod_id] if text is None else tok.encode(text)
        ids += part
        counted += [int(c)] * len(part)
    assert _as_lists(it) == _expected_item([(ids, counted)], seq, tok.eod_id)


def _check_layout_as_transformers(it, segments, hf, tok, seq, appended: bool):
    """``segments`` (text, or None for the eos text; counted) joined and tokenized whole by transformers (special
    tokens matched, as ``apply_chat_template`` does), the tokens of each counted segment counted as transformers'
    assistant mask counts a span: from the token of its first character through the token of its last; with
    ``appended``, the last segment is the eod tnlg appends after the rendering."""
    text, spans = "", []
    for t, c in segments[:-1] if appended else segments:
        piece = hf.eos_token if t is None else t
        if c:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    enc = hf(text, add_special_tokens=False)
    ids = list(enc["input_ids"])
    counted = [0] * len(ids)
    for a, b in spans:
        first, last = enc.char_to_token(a), enc.char_to_token(b - 1)
        counted[first:last + 1] = [1] * (last + 1 - first)
    if appended:
        ids, counted = ids + [tok.eod_id], counted + [int(segments[-1][1])]
    assert _as_lists(it) == _expected_item([(ids, counted)], seq, tok.eod_id)


def test_builtin_chat_template(tmp_path, any_tok):
    tok = any_tok
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    it, report = _only_item(path, tok, seq=160)
    _check_layout(it, [("<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n", 0), ("Hello.", 1), (None, 1),
                       ("<|user|>\nBye?\n<|assistant|>\n", 0), ("Goodbye.", 1), (None, 1)], tok, 160)
    assert report.template == "the built-in chat template"


def _hf_folder(tmp_path, tok, template):
    from tnlg.data.hf_tokenizer import hf_tokenizer_files
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, data in hf_tokenizer_files(tok, 64).items():
        (folder / name).write_bytes(data)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("template", ["turn_by_turn", "generation"])
def test_hf_folder_chat_template(tmp_path, any_tok, template):
    transformers = pytest.importorskip("transformers")
    folder = _hf_folder(tmp_path, any_tok, CHATML if template == "turn_by_turn" else GENERATION)
    folder_tok = load_tokenizer(str(folder))
    assert folder_tok.kind == any_tok.kind
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    it, report = _only_item(path, folder_tok, seq=200)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), split_special_tokens=False)
    rendered = hf.apply_chat_template(CHAT, tokenize=False)
    if template == "turn_by_turn":
        segs = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", 0),
                ("Hello.<|im_end|>\n", 1),
                ("<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", 0), ("Goodbye.<|im_end|>\n", 1), (None, 1)]
        assert "".join(t for t, _ in segs if t) == rendered
    else:
        segs = [("[system] Be brief.\n[user] Hi!\n[A] ", 0), ("Hello.", 1), (None, 1),
                ("[user] Bye?\n[A] ", 0), ("Goodbye.", 1), (None, 1)]
        assert "".join(t or hf.eos_token for t, _ in segs) == rendered
        assert hf.eos_token == ("</s>" if any_tok.kind == "sentencepiece" else "<|endoftext|>")
        out = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert it["loss_mask"].tolist()[:len(out["input_ids"]) - 1] == out["assistant_masks"][1:]
    _check_layout_as_transformers(it, segs, hf, folder_tok, 200, appended=template == "turn_by_turn")
    assert report.template == f"the chat template of {folder / 'tokenizer_config.json'}"


@pytest.mark.parametrize("template", ["builtin", "turn_by_turn", "generation"])
def test_a_conversations_prompt_is_what_fine_tuning_saw_before_its_last_turn(tmp_path, any_tok, template):
    """`tnlg eval --task generate` on a `messages` row: the prompt is the turns before the last assistant turn,
    rendered as transformers' apply_chat_template(add_generation_prompt=True) renders them (written out below),
    with a folder's template the very ids apply_chat_template gives, and the fine-tuning sample of the whole row
    starts with those ids, its first counted token right after them."""
    from tnlg.data.chat import chat_template_for
    from tnlg.data.sft import tokenize_rows
    from tnlg.data.sft_rows import read_rows
    from tnlg.eval.completion_rows import read_completion_rows
    from tnlg.eval.predictions import rows_prompt_ids
    if template == "builtin":
        folder_tok = any_tok
        segs = [("<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n", 0), ("Hello.", 1), (None, 1),
                ("<|user|>\nBye?\n<|assistant|>\n", 0)]
    else:
        transformers = pytest.importorskip("transformers")
        folder = _hf_folder(tmp_path, any_tok, CHATML if template == "turn_by_turn" else GENERATION)
        folder_tok = load_tokenizer(str(folder))
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        if template == "turn_by_turn":
            segs = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                     "<|im_start|>assistant\n", 0), ("Hello.<|im_end|>\n", 1),
                    ("<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", 0)]
        else:
            segs = [("[system] Be brief.\n[user] Hi!\n[A] ", 0), ("Hello.", 1), (None, 1), ("[user] Bye?\n[A] ", 0)]
        rendered = hf.apply_chat_template(CHAT[:-1], add_generation_prompt=True, tokenize=False)
        assert "".join(hf.eos_token if t is None else t for t, _ in segs) == rendered
    if template == "builtin":  # the built-in template: each text encoded on its own (docs/finetune.md)
        want = [i for t, _ in segs for i in ([folder_tok.eod_id] if t is None else folder_tok.encode(t))]
    elif template == "turn_by_turn":  # a folder's template: transformers' own ids of the prompt
        want = list(hf.apply_chat_template(CHAT[:-1], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
    elif folder_tok.kind == "gpt2-bpe":  # the template writes eos_token's text, which fine-tuning turns into the
        # end-of-document id (this folder's vocabulary does not hold it as one token): transformers' ids of each
        # stretch between them
        pieces = rendered.split(hf.eos_token)
        want = [i for k, piece in enumerate(pieces)
                for i in ([folder_tok.eod_id] if k else []) + (hf(piece, add_special_tokens=False)["input_ids"]
                                                               if piece else [])]
    else:  # (SentencePiece: a stretch after that id takes no dummy prefix, which transformers cannot be asked
        # for piece by piece; the fine-tuning sample below is the reference, its ids checked against
        # apply_chat_template in tests/test_chat_templates.py)
        want = None
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    rows = read_completion_rows(path)
    assert rows[0].references == ("Goodbye.",)
    ids = rows_prompt_ids(folder_tok, rows)[0]
    assert want is None or ids == want
    trained, counted = tokenize_rows(read_rows(path), folder_tok, chat_template_for(folder_tok)).sample(0)
    if template == "generation" and folder_tok.kind == "sentencepiece":
        # the prompt ends inside a stretch the whole row encodes at once ("[A] " then "Goodbye."): SentencePiece
        # gives the prompt's last space a token of its own where the row has "▁Goodbye", as transformers' own
        # prompt does; the ids before that stretch are the row's
        start = len(ids) - len(folder_tok.encode("[A] "))
        assert trained[:start].tolist() == ids[:start]
        return
    assert trained[:len(ids)].tolist() == ids and counted[len(ids)] and not counted[len(ids) - 1]


def test_hf_folder_without_a_template_uses_the_builtin(tmp_path, tok):
    folder = _hf_folder(tmp_path, tok, None)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:3]}])
    it, report = _only_item(path, load_tokenizer(str(folder)), seq=64)
    _check_layout(it, [("<|user|>\nHi!\n<|assistant|>\n", 0), ("Hello.", 1), (None, 1)], tok, 64)
    assert report.template == "the built-in chat template"


@pytest.mark.needs_package("pyarrow")
def test_parquet_rows_read_like_jsonl(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = _pc(PAIRS)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pc.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}, {"messages": CHAT[1:3]}]), tmp_path / "chat.parquet")
    _jsonl(tmp_path / "pc.jsonl", rows)
    _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:3]}])
    for name in ("pc", "chat"):
        a, _, ra = _build(tmp_path / f"{name}.parquet", tok, seq=96, train_samples=4)
        b, _, rb = _build(tmp_path / f"{name}.jsonl", tok, seq=96, train_samples=4)
        assert ra.line() == rb.line()
        assert all(_as_lists(a[i]) == _as_lists(b[i]) for i in range(4))


@pytest.mark.needs_package("datasets")
def test_datasets_folder_rows_read_like_jsonl(tmp_path, tok):
    import datasets
    rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "chat_ds"))
    a, _, ra = _build(tmp_path / "chat_ds", tok, seq=96, train_samples=2)
    b, _, rb = _build(_jsonl(tmp_path / "chat.jsonl", rows), tok, seq=96, train_samples=2)
    assert ra.line() == rb.line() and all(_as_lists(a[i]) == _as_lists(b[i]) for i in range(2))


def test_cache_tokenizes_once(tmp_path, tok, monkeypatch):
    import tnlg.data.sft as sft
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    first, _, r1 = _build(path, tok, train_samples=6, cache_dir=str(tmp_path / "cache"))
    assert len(os.listdir(tmp_path / "cache")) == 1
    calls = []
    monkeypatch.setattr(sft, "tokenize_segments", lambda *a, **k: calls.append(1))
    again, _, r2 = _build(path, tok, train_samples=6, cache_dir=str(tmp_path / "cache"),
                          barrier=lambda: calls.append("barrier"))
    assert calls == ["barrier"] and r1.line() == r2.line()
    assert all(_as_lists(first[i]) == _as_lists(again[i]) for i in range(6))


def test_validation_split_and_report_line(tmp_path, tok):
    train = _jsonl(tmp_path / "t.jsonl", _pc(PAIRS))
    valid = _jsonl(tmp_path / "v.jsonl", _pc(PAIRS[:2]))
    tr, va, report = build_sft_datasets(train, valid, tok, SEQ, train_samples=7, valid_samples=3, seed=1)
    assert (len(tr), len(va)) == (7, 3)
    assert report.valid is not None and report.valid.samples == 2
    assert report.line().startswith(f"{len(PAIRS)} samples into {report.sequences} sequences, ")
    assert "(validation: 2 samples into 1 sequences," in report.line()


# ----------------------------------------------------------------------------------- bad input

BAD_ROWS = [
    ({"text": "plain"}, ["bad.jsonl:2", "'text'", '"prompt"', '"completion"', '"messages"']),
    ({"prompt": "q"}, ["bad.jsonl:2", "without a completion"]),
    ({"prompt": "q", "completion": ""}, ["bad.jsonl:2", "'completion' is empty"]),
    ({"prompt": "q", "completion": 3}, ["bad.jsonl:2", "int, not a string"]),
    ({"prompt": "q", "completion": "a", "response": "b"}, ["both 'completion' and 'response'"]),
    ({"messages": [{"role": "robot", "content": "x"}]}, ["bad.jsonl:2", "'robot'", "['system', 'user', 'assistant']"]),
    ({"messages": [{"role": "assistant", "content": "x"}]}, ["turn 0 is 'assistant' where 'user' is due"]),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
     ["turn 1 is 'user' where 'assistant' is due"]),
    ({"messages": [{"role": "user", "content": "a"}]}, ["ends with 'user'", "must end with an assistant turn"]),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
     ["turn 1 (assistant) is empty"]),
    ({"messages": []}, ["'messages' is empty"]),
    ("{not json", ["bad.jsonl:2", "malformed JSON"]),
]


@pytest.mark.parametrize("row,words", BAD_ROWS, ids=[w[-1][:30] for _, w in BAD_ROWS])
def test_bad_rows_are_one_paragraph_naming_file_and_line(tmp_path, tok, row, words):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "completion": "row"}, row])
    with pytest.raises(UserError) as err:
        _build(path, tok)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_empty_file_and_no_usable_sample(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="has no rows"):
        _build(empty, tok)
    path = _jsonl(tmp_path / "long.jsonl", _pc([("word " * 40, "a")]))
    with pytest.raises(UserError, match="no usable sample.*all skipped"):
        _build(path, tok, seq=8)
    with pytest.raises(UserError, match="does not exist"):
        _build(tmp_path / "missing.jsonl", tok)


class _OtherTokenizer(Tokenizer):
    kind = "other"
    _vocab, _eod = 300, 0

    def encode(self, text):
        return list(text.encode("utf-8"))

    def describe(self):
        return {"kind": "other", "path": None, "sha256": None}


def test_messages_need_a_template_where_no_builtin_applies(tmp_path, tok):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(UserError, match="need a chat template.*has none"):
        _build(path, _OtherTokenizer())
    pc = _jsonl(tmp_path / "pc.jsonl", _pc(PAIRS[:1]))  # prompt/completion rows need none
    assert _build(pc, _OtherTokenizer(), seq=80)[2].samples == 1


def test_a_template_that_fails_is_one_paragraph(tmp_path, tok):
    pytest.importorskip("transformers")
    folder = _hf_folder(tmp_path, tok, "{{ raise_exception('no system turns please') }}")
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(UserError, match="failed on a conversation.*no system turns please"):
        _build(path, load_tokenizer(str(folder)))


def test_the_launchers_check_writes_the_tokens_the_workers_read(tmp_path, monkeypatch):
    """`tnlg finetune` reads and tokenizes every row in the launching process (to refuse bad rows before any
    worker starts); its workers then read that cache (default $TNLG_CACHE/sft) instead of tokenizing again."""
    import types

    import tnlg.data.sft as sft
    from tnlg.commands.pretrain import check_sft_data
    from tnlg.training.setup import _sft_datasets
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    rows = _jsonl(tmp_path / "rows.jsonl", _pc(PAIRS))
    data = types.SimpleNamespace(sft_data_path=rows, sft_valid_data_path=None, tokenizer_path=lambda: "builtin",
                                 seed=1234, packing=True, sft_loss_on_prompt=False, data_cache_path=None)
    o = types.SimpleNamespace(data=data, model=types.SimpleNamespace(seq_length=SEQ))  # what the two read
    calls = []
    real = sft.tokenize_segments
    monkeypatch.setattr(sft, "tokenize_segments", lambda *a, **k: calls.append(1) or real(*a, **k))
    check_sft_data(o)  # the launching process
    assert calls == [1] and len(os.listdir(tmp_path / "cache" / "sft")) == 1
    tok = load_tokenizer("builtin")
    cfg = types.SimpleNamespace(seq_length=o.model.seq_length)
    train, _ = _sft_datasets(o, cfg, tok, 4, 0, barrier=lambda: calls.append("barrier"))  # a worker (rank 0)
    assert calls == [1, "barrier"] and len(train) == 4


def test_an_unwritable_cache_tokenizes_in_memory(tmp_path, tok):
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    a, _, ra = _build(path, tok, train_samples=6, cache_dir=str(blocked))
    b, _, rb = _build(path, tok, train_samples=6, cache_dir=str(tmp_path / "cache"))
    assert ra.line() == rb.line() and all(_as_lists(a[i]) == _as_lists(b[i]) for i in range(6))


# ----------------------------------------------------------------------------------- the tokenized cache

BOS_TEMPLATE = ("{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ bos_token }}[assistant] {% endif %}")


def _fresh_items(path, tok, count, tmp_path, **kw):
    return [_as_lists(it) for it in _all_items(_build(path, tok, cache_dir=str(tmp_path / "fresh"),
                                                      train_samples=count, **kw)[0], count)]


def test_the_cache_follows_every_special_token_of_the_folder(tmp_path, tok):
    """Changing the folder's bos_token (which the template reads) gives the new tokens, not the cached ones."""
    transformers = pytest.importorskip("transformers")
    folder = _hf_folder(tmp_path, tok, BOS_TEMPLATE)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    cache = str(tmp_path / "cache")
    first = _as_lists(_build(path, load_tokenizer(str(folder)), seq=200, cache_dir=cache, packing=False)[0][0])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "</s>"
    config["bos_token"] = "<s>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").unlink()  # which transformers would read over tokenizer_config.json
    assert transformers.AutoTokenizer.from_pretrained(str(folder)).bos_token == "<s>"
    folder_tok = load_tokenizer(str(folder))
    again = _as_lists(_build(path, folder_tok, seq=200, cache_dir=cache, packing=False)[0][0])
    assert again != first and again == _fresh_items(path, folder_tok, 1, tmp_path, seq=200, packing=False)[0]
    assert again["tokens"][0] == 1 and first["tokens"][0] == tok.eod_id == 2  # <s> is id 1, </s> id 2
    assert len(os.listdir(cache)) == 2


def test_the_cache_follows_the_rows_content_not_the_files_stamp(tmp_path, tok):
    """Rows rewritten with the same size and modification time are tokenized again."""
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    stat = os.stat(path)
    cache = str(tmp_path / "cache")
    first = [_as_lists(it) for it in _all_items(_build(path, tok, train_samples=6, cache_dir=cache)[0], 6)]
    _jsonl(path, _pc([(p, c.replace("a", "b")) for p, c in PAIRS]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    again = [_as_lists(it) for it in _all_items(_build(path, tok, train_samples=6, cache_dir=cache)[0], 6)]
    assert again != first and again == _fresh_items(path, tok, 6, tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "not_npz", "wrong_arrays"])
def test_a_damaged_cache_is_rebuilt_with_a_note_naming_it(tmp_path, tok, capsys, damage):
    import numpy as np
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    cache = tmp_path / "cache"
    first = [_as_lists(it) for it in _all_items(_build(path, tok, train_samples=6, cache_dir=str(cache))[0], 6)]
    (file,) = cache.iterdir()
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[:len(data) // 2])
    elif damage == "zeroed":
        file.write_bytes(data[:100] + bytes(len(data) - 200) + data[-100:])
    elif damage == "not_npz":
        file.write_text("hello")
    else:
        with open(file, "wb") as f:
            np.savez(f, ids=np.arange(5), counted=np.ones(5, bool), offsets=np.array([0, 5]))
    capsys.readouterr()
    for barrier in (None, lambda: None):  # one process; rank 0 of several
        again = [_as_lists(it) for it in _all_items(_build(path, tok, train_samples=6, cache_dir=str(cache),
                                                           barrier=barrier)[0], 6)]
        assert again == first
        err = capsys.readouterr().err
        if barrier is None:
            assert f"note: the tokenized cache {file} of {path} is unreadable" in err, err
        else:  # rewritten by the run before: read silently
            assert err == ""
    assert file.read_bytes() == data


def test_the_cache_is_written_durably(tmp_path, tok, monkeypatch):
    """The cache file is fsynced before it is renamed into place."""
    import tnlg.io
    synced = []
    real = os.fsync
    monkeypatch.setattr(tnlg.io.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    _build(path, tok, train_samples=6, cache_dir=str(tmp_path / "cache"))
    (file,) = (tmp_path / "cache").iterdir()
    assert any(os.path.dirname(s) == str(tmp_path / "cache") and s != str(file) for s in synced), synced


def test_a_damaged_cache_read_by_another_rank_is_tokenized_there_with_a_note(tmp_path, tok, capsys, monkeypatch):
    """A rank other than 0 that finds the cache damaged after the barrier tokenizes the rows itself."""
    import tnlg.data.sft as sft
    path = _jsonl(tmp_path / "a.jsonl", _pc(PAIRS))
    cache = tmp_path / "cache"
    first = [_as_lists(it) for it in _all_items(_build(path, tok, train_samples=6, cache_dir=str(cache))[0], 6)]
    (file,) = cache.iterdir()
    monkeypatch.setattr(sft, "_rank", lambda: 1)
    capsys.readouterr()
    again = [_as_lists(it) for it in _all_items(_build(path, tok, train_samples=6, cache_dir=str(cache),
                                                       barrier=lambda: file.write_bytes(b"PK\x03\x04"))[0], 6)]
    assert again == first
    assert f"note: the tokenized cache {file} of {path} is unreadable" in capsys.readouterr().err
