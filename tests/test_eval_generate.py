"""`tnlg eval --task generate`: ROUGE equal to rouge_score's, exact match and token F1 equal to SQuAD v1.1's
official definitions, and greedy predictions equal to `transformers` generate on the exported folder, token for
token, at TP 1 and TP 2."""

import json
import re
import string
from collections import Counter

import pytest
import torch

from tests.hf_reference import random_gpt2
from tnlg.cli import main
from tnlg.eval.porter import porter_stem
from tnlg.eval.scoring import exact_match, mean_scores, normalize_answer, rouge_f, score_example, token_f1

pytestmark = pytest.mark.usefixtures("one_thread")

# punctuation, case, repeated words, empty strings, unicode (accents, a ligature, an emoji, CJK, the Kelvin sign
# that lower-cases to an ASCII k), digits, articles, hyphens and apostrophes
TEXTS = ["", "   ", "The cat sat on the mat.", "the cat, the CAT; the cat!", "A cat sat on a mat",
         "cat cat cat cat", "mat on sat cat the", "An apple a day keeps the doctor away.",
         "Café naïve résumé — déjà vu", "cafe naive resume deja vu", "ﬁnal ﬁve 🎭 masks 🎭", "東京 is in 日本",
         "\u212aelvin kelvin KELVIN", "3.14159 is pi; 2,718 is e", "don't won't can't", "state-of-the-art models",
         "the", "a an the", "x", "x y x y x y", "New\nline\ttab  spaces", "(1) (2) (3)",
         "Über straße façade", "it's the end of the world as we know it"]
RELATED = [("the cat sat on the mat", "on the mat the cat sat down"), ("a b c d e f", "a b x c d y e f"),
           ("police killed the gunman", "the gunman police killed"), ("x y x y x y", "y x y"),
           ("Über straße façade", "über strasse façade"), ("one two three two one", "two one two three")]
STEMMED = [("The cats were running quickly", "a cat runs quick"), ("generously hopeful relations", "generous hope "
           "relational"), ("Conditional probabilities", "conditions of probability"), ("skies lying", "sky lie"),
           ("he has its bus", "he ha it bu")]  # words of 3 letters are not stemmed
PAIRS = [(r, p) for r in TEXTS for p in TEXTS[::3]] + [(TEXTS[i], TEXTS[i + 1]) for i in range(len(TEXTS) - 1)] + \
    RELATED + [(p, r) for r, p in RELATED]


# ----------------------------------------------------------------------------- SQuAD v1.1, as the official script

def squad_normalize_answer(s):
    """evaluate-v1.1.py's normalize_answer, as published."""
    def remove_articles(text):
        return re.sub(r'\b(a|an|the)\b', ' ', text)

    def white_space_fix(text):
        return ' '.join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return ''.join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def squad_f1_score(prediction, ground_truth):
    prediction_tokens = squad_normalize_answer(prediction).split()
    ground_truth_tokens = squad_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1


def squad_exact_match_score(prediction, ground_truth):
    return squad_normalize_answer(prediction) == squad_normalize_answer(ground_truth)


def squad_max_over_ground_truths(metric_fn, prediction, ground_truths):
    return max(metric_fn(prediction, gt) for gt in ground_truths)


def test_exact_match_and_f1_are_squads():
    for reference, prediction in PAIRS:
        assert normalize_answer(prediction) == squad_normalize_answer(prediction)
        assert token_f1(reference, prediction) == squad_f1_score(prediction, reference), (reference, prediction)
        assert exact_match(reference, prediction) == float(squad_exact_match_score(prediction, reference))
    several = ["the cat sat", "A dog ran.", "cat"]
    for prediction in TEXTS:
        assert token_f1(several, prediction) == squad_max_over_ground_truths(squad_f1_score, prediction, several)
        assert exact_match(several, prediction) == float(
            squad_max_over_ground_truths(squad_exact_match_score, prediction, several))
    assert exact_match("The Cat!", "cat") == 1.0 and token_f1("", "") == 0.0  # v1.1: nothing shared scores 0


# stems and suffixes that reach every rule of the Porter stemmer's steps (and nltk's departures), combined
STEMS = ["h", "y", "yy", "ay", "by", "tr", "oat", "troubl", "priv", "conflat", "hop", "fil", "fall", "hiss", "fizz",
         "happ", "sk", "enjo", "relat", "condit", "val", "hesit", "digit", "conform", "radic", "differ", "vil",
         "analog", "vietnam", "predic", "oper", "feud", "decis", "hope", "call", "form", "sensit", "sensib", "tripl",
         "electr", "good", "reviv", "allow", "infer", "airlin", "gyroscop", "adjust", "defens", "irrit", "replac",
         "depend", "adopt", "homolog", "commun", "activ", "angular", "effect", "bowdl", "prob", "rat", "ceas",
         "control", "rol", "a", "e", "io", "xy", "qwx", "bb", "ab", "gen", "oy", "uy", "9x", "x1y", "d", "l", "t"]
SUFFIXES = ["", "s", "es", "ies", "sses", "ss", "ed", "ied", "eed", "ing", "y", "ational", "tional", "enci", "anci",
            "izer", "bli", "abli", "alli", "entli", "eli", "ousli", "ization", "ation", "ator", "alism", "iveness",
            "fulness", "ousness", "aliti", "iviti", "biliti", "fulli", "logi", "icate", "ative", "alize", "iciti",
            "ical", "ful", "ness", "al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent",
            "sion", "tion", "ion", "ou", "ism", "ate", "iti", "ous", "ive", "ize", "e", "ll", "lled", "lling", "tted",
            "zzed", "ssing", "yy", "ying", "yed"]
WORDS = ["caresses", "ponies", "ties", "cats", "feed", "agreed", "plastered", "bled", "motoring", "sing", "skies",
         "dying", "lying", "news", "innings", "outings", "cannings", "howe", "proceed", "exceed", "succeeded",
         "generously", "hopefully", "archaeology", "syzygy", "toy", "trees", "ivy", "orrery", "oaten", "by", "y"]


@pytest.mark.needs_package("rouge_score")
def test_porter_stem_is_nltks():
    """rouge_score's stemmer is nltk's PorterStemmer(): equal on every stem + suffix (+ suffix) combination,
    the paper's examples and random letter strings."""
    from nltk.stem import porter
    import random
    rng = random.Random(0)
    words = set(WORDS) | {s + a + b for s in STEMS for a in SUFFIXES for b in ("", "ing", "ness")}
    words |= {"".join(rng.choice("aeiouybcdlmnrstxwz") for _ in range(rng.randint(1, 12))) for _ in range(2000)}
    nltk_stem = porter.PorterStemmer().stem
    wrong = [(w, porter_stem(w), nltk_stem(w)) for w in sorted(words) if porter_stem(w) != nltk_stem(w)]
    assert not wrong, wrong[:20]
    assert len({porter_stem(w) for w in words}) < len(words) - 2000  # it does conflate


@pytest.mark.needs_package("rouge_score")
@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("stem", [False, True])
def test_rouge_is_rouge_scores(several, stem):
    """Every pair's F-measure equals rouge_score's, with and without stemming, float for float; with several
    references the best (score_multi); the mean over the examples is numpy's mean of rouge_score's figures."""
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=stem)
    ours, theirs = [], []
    for reference, prediction in PAIRS + STEMMED * stem:
        refs = [reference, "the cat sat on a mat", prediction[:len(prediction) // 2]] if several else reference
        want = scorer.score_multi(refs, prediction) if several else scorer.score(reference, prediction)
        got = rouge_f(refs, prediction, use_stemmer=stem)
        assert got == {k: v.fmeasure for k, v in want.items()}, (refs, prediction)
        ours.append(score_example(refs, prediction, use_stemmer=stem))
        theirs.append(want)
    assert sum(0 < s["rougeL"] < 1 for s in ours) > 20 and sum(0 < s["rouge2"] < 1 for s in ours) > 10
    means = mean_scores(ours)
    for k in ("rouge1", "rouge2", "rougeL"):
        assert means[k] == pytest.approx(float(__import__("numpy").mean([s[k].fmeasure for s in theirs])),
                                         rel=1e-15, abs=0)


# ----------------------------------------------------------------------------- the command against transformers

PROMPTS = ["To be, or not to be", "  O Romeo,\nRomeo!", "Of Man's first disobedience 🎭", "What", "",
           "Now is the winter of our discontent made glorious summer by this sun of York",
           "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: Rough winds do shake "
           "the darling buds of May, And summer's lease hath all too short a date; Sometime too hot the"]  # 57 tokens
NEW = 10
SEQ = 64


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A random GPT-2 converted to a tnlg checkpoint (the built-in tokenizer recorded), exported back with
    `tnlg convert --to hf`; transformers' greedy generate on the exported folder (one prompt at a time, the
    folder's own tokenizer); a data file whose references are built from those predictions."""
    import transformers
    from tnlg.data.tokenizer import load_tokenizer
    root = tmp_path_factory.mktemp("eval_generate")
    tok = load_tokenizer("builtin")
    hf_in = random_gpt2(tok.vocab_size, SEQ, seed=3, std=0.3, bos_token_id=tok.eod_id, eos_token_id=tok.eod_id)
    with torch.no_grad():  # the end-of-document token made likelier: some rows stop early, some do not
        hf_in.transformer.wte.weight[tok.eod_id] += 12 * hf_in.transformer.ln_f.bias
    hf_in.save_pretrained(root / "hf_in")
    ckpt, out = str(root / "ckpt"), str(root / "hf_out")
    assert main(["convert", "--from", "hf", str(root / "hf_in"), "--to", ckpt, "--tokenizer-model", "builtin"]) == 0
    assert main(["convert", "--from", ckpt, "--to", "hf", out]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = hf_tok(prompt)["input_ids"]
            assert ids == tok.encode(prompt)  # the folder's tokenizer: no extra BOS
            ids = ids or [tok.eod_id]  # an empty prompt starts from the EOD id
            new = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=min(NEW, SEQ - len(ids)), do_sample=False,
                              eos_token_id=tok.eod_id, pad_token_id=tok.eod_id)[0, len(ids):].tolist()
            want.append(new[:new.index(tok.eod_id) + 1] if tok.eod_id in new else new)
    body = [w[:-1] if w and w[-1] == tok.eod_id else w for w in want]
    texts = [hf_tok.decode(hf_tok(p)["input_ids"] + b)[len(hf_tok.decode(hf_tok(p)["input_ids"])):]
             for p, b in zip(PROMPTS, body)]
    references = []  # the prediction itself, a list holding it upper-cased, or half its words and more
    for i, t in enumerate(texts):
        t = t if t.strip() else "nothing"
        references.append(t if i % 2 == 0 else [t.upper() + " x", "unrelated words"] if i % 3 == 1 else
                          " ".join(t.split()[:max(1, len(t.split()) // 2)]) + " and more")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, ("completion" if i % 2 else "response"): r}) + "\n\n"
                            for i, (p, r) in enumerate(zip(PROMPTS, references))))
    assert len(set(sum(want, []))) > 8  # not one token repeated
    ends = [w[-1] == tok.eod_id if w else True for w in want]
    assert sum(ends) >= 2 and not all(ends) and 0 < len(want[-1]) < NEW  # EOD stops; the last prompt is cut
    return dict(root=root, ckpt=ckpt, hf=out, want=want, texts=texts, references=references, data=str(data))


def _run(capfd, argv):
    capfd.readouterr()
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


def _check(exported, result, predictions_file):
    rows = [json.loads(line) for line in open(predictions_file, encoding="utf-8")]
    assert [r["tokens"] for r in rows] == exported["want"]
    assert [r["prediction"] for r in rows] == exported["texts"]
    assert [r["prompt"] for r in rows] == PROMPTS and [r["reference"] for r in rows] == exported["references"]
    assert result["count"] == len(PROMPTS) and result["cut_by_seq_length"] == 1
    assert result["exact_match"] == pytest.approx(sum(r["exact_match"] for r in rows) / len(rows))
    assert 0 < result["exact_match"] < 1 and 0 < result["rougeL"] < 1  # the references built to score between
    return rows


def test_predictions_equal_transformers_greedy_at_tp1(exported, tmp_path, capfd):
    """From the tnlg checkpoint (batches of 4, left-padded) and from the exported folder: the predictions
    file holds transformers' tokens and texts; the printed means are the rows' means."""
    base = ["eval", "--task", "generate", "--data", exported["data"], "--max-new-tokens", str(NEW), "--json"]
    # the exported folder's SentencePiece model is its tokenizer.model (tnlg reads GPT-2 BPE folders' files alone)
    for name, ckpt in (("ckpt", [exported["ckpt"]]), ("hf", [exported["hf"], "--tokenizer-model", exported["hf"]])):
        preds = str(tmp_path / f"{name}.jsonl")
        result = _run(capfd, base + ["--checkpoint", *ckpt, "--predictions-file", preds, "--micro-batch-size", "4"])
        _check(exported, result, preds)
    capfd.readouterr()
    assert main(base[:-1] + ["--checkpoint", exported["ckpt"]]) == 0  # the table
    table = capfd.readouterr().out
    assert re.search(r"rougeL\s+0\.\d", table) and re.search(r"count\s+7", table), table


@pytest.mark.slow
def test_predictions_equal_transformers_greedy_at_tp2(exported, tmp_path, capfd):
    preds = str(tmp_path / "tp2.jsonl")
    result = _run(capfd, ["eval", "--task", "generate", "--data", exported["data"], "--max-new-tokens", str(NEW),
                          "--checkpoint", exported["ckpt"], "--predictions-file", preds, "--json",
                          "--nproc-per-node", "2", "--tp", "2"])
    assert result["tensor_model_parallel_size"] == 2
    _check(exported, result, preds)


@pytest.mark.needs_package("rouge_score")
@pytest.mark.parametrize("stem", [False, True])
def test_printed_rouge_is_rouge_scores_on_the_written_predictions(exported, tmp_path, capfd, stem):
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=stem)
    preds = str(tmp_path / "p.jsonl")
    result = _run(capfd, ["eval", "--task", "generate", "--data", exported["data"], "--checkpoint", exported["hf"],
                          "--tokenizer-model", exported["hf"], "--max-new-tokens", str(NEW), "--predictions-file",
                          preds, "--json"] + ["--rouge-use-stemmer"] * stem)
    assert result["rouge_use_stemmer"] is stem
    rows = [json.loads(line) for line in open(preds, encoding="utf-8")]
    for k in ("rouge1", "rouge2", "rougeL"):
        per_row = [(scorer.score if isinstance(r["reference"], str) else scorer.score_multi)(
            r["reference"], r["prediction"])[k].fmeasure for r in rows]
        assert [r[k] for r in rows] == per_row
        assert result[k] == pytest.approx(sum(per_row) / len(per_row), rel=1e-15)


def _expect_error(capfd, argv, *needles):
    capfd.readouterr()
    assert main(argv) == 2
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err
    for needle in needles:
        assert needle in captured.err, captured.err


def test_bad_input_is_one_paragraph_before_any_work(exported, tmp_path, capfd):
    base = ["eval", "--task", "generate", "--checkpoint", exported["ckpt"], "--data"]
    good = exported["data"]
    _expect_error(capfd, base + [str(tmp_path / "missing.jsonl")], "does not exist")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    _expect_error(capfd, base + [str(tmp_path / "empty.jsonl")], "has no rows")
    bad = tmp_path / "bad.jsonl"
    for text, needles in (('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n', ["bad.jsonl:2:", '"completion"']),
                          ('{"completion": "b"}\n', ["bad.jsonl:1:", 'no "prompt"']),
                          ('{"prompt": "a", "response": ["b", 3]}\n', ["bad.jsonl:1:", "list of strings"]),
                          ('{"prompt": "a", "completion": "  "}\n', ["bad.jsonl:1:", "empty reference"]),
                          ('{"prompt": "a", "completion": "b", "response": "c"}\n', ["bad.jsonl:1:", "both"]),
                          ('[1, 2]\n', ["bad.jsonl:1:", "not an object"]), ("{oops\n", ["bad.jsonl:1:", "malformed JSON"])):
        bad.write_text(text)
        _expect_error(capfd, base + [str(bad)], *needles)
    _expect_error(capfd, base + [good, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1")
    _expect_error(capfd, base + [good, "--predictions-file", str(tmp_path / "no" / "p.jsonl")], "does not exist")
    _expect_error(capfd, base + [good, "--predictions-file", str(tmp_path)], "is a folder")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 200, "completion": "x"}) + "\n")
    _expect_error(capfd, base + [str(long)], "longer than the model's seq_length")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.jsonl", "long.jsonl"]


@pytest.mark.parametrize("line,problem", [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "completion": "x"}', "nested deeper than"),
    ('{"prompt": "half \\ud800 a pair", "completion": "x"}', "the value of 'prompt' holds '\\ud800' at character 5"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", "content": "x"}]}',
     "the value of 'messages'[0]['content'] holds '\\udfff'"),
], ids=["nested", "surrogate", "surrogate_in_a_turn"])
def test_a_row_no_tokenizer_can_take_is_one_paragraph_before_any_model_loads(exported, tmp_path, capfd, monkeypatch,
                                                                             line, problem):
    """A row nested past Python's JSON parser, or holding half a UTF-16 surrogate pair (valid JSON, no
    character: SentencePiece raises on it): one paragraph naming the file and the line, no model loaded."""
    import tnlg.generation.loading as loading

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for rows that cannot be read")
    monkeypatch.setattr(loading, "load_model", no_model)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a fine row", "completion": "x"}\n' + line + "\n")
    capfd.readouterr()
    assert main(["eval", "--task", "generate", "--checkpoint", exported["ckpt"], "--data", str(path)]) == 2
    err = capfd.readouterr().err
    assert f"{path}:2: " in err and problem in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.needs_package("pyarrow")
def test_conversation_rows_are_prompted_as_fine_tuning_renders_them(exported, tmp_path, capfd):
    """`messages` rows (here in a Parquet file): the prompt is the turns before the last assistant turn in the
    built-in chat template (docs/finetune.md: `<|role|>\\n{content}\\n` per system/user turn, then
    `<|assistant|>\\n`; an earlier assistant turn's content then the end-of-document id, each text encoded
    apart), the reference the last assistant turn. The tokens are transformers' greedy continuation of those
    ids on the exported folder; the predictions file names each row (from 0) and holds the turns asked."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import transformers
    from tnlg.data.tokenizer import load_tokenizer
    tok = load_tokenizer("builtin")
    eod = tok.eod_id
    chats = [[("user", PROMPTS[0]), ("assistant", "yes")],
             [("system", "Be brief."), ("user", PROMPTS[2]), ("assistant", "an answer")],
             [("user", "What"), ("assistant", "Now is"), ("user", PROMPTS[1]), ("assistant", "Juliet")],
             [("user", ""), ("assistant", "nothing asked")]]
    want_ids = [tok.encode(f"<|user|>\n{PROMPTS[0]}\n<|assistant|>\n"),
                tok.encode(f"<|system|>\nBe brief.\n<|user|>\n{PROMPTS[2]}\n<|assistant|>\n"),
                tok.encode("<|user|>\nWhat\n<|assistant|>\n") + tok.encode("Now is") + [eod]
                + tok.encode(f"<|user|>\n{PROMPTS[1]}\n<|assistant|>\n"),
                tok.encode("<|user|>\n\n<|assistant|>\n")]
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported["hf"]).eval()
    want = []
    with torch.no_grad():
        for ids in want_ids:
            new = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=min(NEW, SEQ - len(ids)), do_sample=False, eos_token_id=eod,
                              pad_token_id=eod)[0, len(ids):].tolist()
            want.append(new[:new.index(eod) + 1] if eod in new else new)
    rows = [{"messages": [{"role": r, "content": c} for r, c in chat], "id": i} for i, chat in enumerate(chats)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    preds = tmp_path / "p.jsonl"
    result = _run(capfd, ["eval", "--task", "generate", "--data", str(tmp_path / "chats.parquet"), "--checkpoint",
                          exported["ckpt"], "--max-new-tokens", str(NEW), "--predictions-file", str(preds),
                          "--micro-batch-size", "3", "--json"])
    got = [json.loads(line) for line in open(preds, encoding="utf-8")]
    assert [g["tokens"] for g in got] == want and result["count"] == len(chats)
    assert [g["row"] for g in got] == list(range(len(chats))) and all("line" not in g for g in got)
    assert [g["reference"] for g in got] == [chat[-1][1] for chat in chats]
    assert [g["messages"] for g in got] == [r["messages"][:-1] for r in rows]
