"""The one rows reader (tnlg.data.rows) behind every command that reads records: pretraining documents,
fine-tuning rows, `tnlg eval --task generate` rows and LAMBADA texts. JSON Lines, Parquet and `datasets`
folders give the same rows; a bad row is one paragraph `FILE:LINE: ...; what a valid row holds` (tables:
`FILE:row N`, rows counted from 0) whichever consumer reads it; a line nested too deep or holding half a
surrogate pair is refused by every consumer with its line."""

import json

import pytest

from tnlg.data.inputs import check_inputs, iter_documents
from tnlg.data.rows import MAX_DEPTH, RowFormat, iter_rows
from tnlg.data.sft_rows import read_rows
from tnlg.errors import UserError
from tnlg.eval.completion_rows import read_completion_rows
from tnlg.eval.lambada import read_lambada_texts

# consumer -> (read the file, a valid row, the field holding text, a phrase of what its valid row holds)
CONSUMERS = {
    "documents": (lambda p: list(iter_documents([p])) and check_inputs([p]), {"text": "a document"}, "text",
                  'a line is one JSON object such as {"text": "document text"}'),
    "finetune": (read_rows, {"prompt": "a question", "completion": "an answer"}, "prompt", "a fine-tuning row is"),
    "generate": (read_completion_rows, {"prompt": "a question", "completion": "an answer"}, "prompt",
                 'a row is {"prompt": str, "completion": str}'),
    "lambada": (read_lambada_texts, {"text": "a passage and its last word"}, "text", 'like {"text": "..."}'),
}


def _nested(depth: int) -> str:
    return '{"x": ' + "[" * depth + "]" * depth + "}"


def _bad_lines(field: str, good: dict) -> dict:
    """Second lines no consumer may take: nested past Python's parser, nested past the bound (which Python
    parses), half a surrogate pair in the consumer's text and in a field it ignores."""
    surrogate = json.dumps({**good, field: "half \ud800 a pair"})
    assert "\\ud800" in surrogate  # the escape, as JSON writes it
    return {
        "deeper_than_python": (_nested(100_000), f"nested deeper than {MAX_DEPTH} levels"),
        "deeper_than_the_bound": (_nested(MAX_DEPTH + 5), f"nested deeper than {MAX_DEPTH} levels"),
        "surrogate_in_text": (surrogate, f"the value of '{field}' holds '\\ud800' at character 5, half of a UTF-16 "
                                         "surrogate pair"),
        "surrogate_elsewhere": (json.dumps({**good, "meta": {"source": ["ok", "x\udc00"]}}),
                                "the value of 'meta'['source'][1] holds '\\udc00' at character 1"),
        "surrogate_as_utf8_bytes": (json.dumps({**good, field: "@@"}).replace("@@", "\udbff"), "holds '\\udbff'"),
        "malformed": ('{"oops', "malformed JSON"),
    }


CASES = [(c, k) for c in CONSUMERS for k in _bad_lines(CONSUMERS[c][2], CONSUMERS[c][1])]


@pytest.mark.parametrize("consumer,case", CASES, ids=[f"{c}-{k}" for c, k in CASES])
def test_every_consumer_refuses_a_bad_line_in_one_format(tmp_path, consumer, case):
    read, good, field, holds = CONSUMERS[consumer]
    line, problem = _bad_lines(field, good)[case]
    path = tmp_path / "rows.jsonl"
    data = (json.dumps(good) + "\n" + line + "\n").encode("utf-8", "surrogatepass")
    path.write_bytes(data)
    with pytest.raises(UserError) as info:
        read(str(path))
    text = str(info.value)
    assert text.startswith(f"{path}:2: ") and problem in text and holds in text and "\n" not in text, text


def test_a_row_at_the_depth_bound_is_read(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"text": "fine", "x": json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))})
                    + "\n")
    assert [t for _, _, t in iter_documents([str(path)])] == ["fine"]


ROWS = [{"prompt": "p0", "completion": "c0", "text": "t0 last"}, {"prompt": "p1", "completion": "c1", "text": "t1 word"},
        {"prompt": "p2", "completion": "c2", "text": "t2 here"}]


def _tables(tmp_path, rows):
    """The rows as JSON Lines, as Parquet (pyarrow) and as a `datasets` folder (datasets' own writer)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    datasets = pytest.importorskip("datasets")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=2)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "rows_ds"), num_shards=2)
    return {"jsonl": str(jsonl), "parquet": str(tmp_path / "rows.parquet"), "datasets": str(tmp_path / "rows_ds")}


@pytest.mark.needs_package("pyarrow", "datasets")
def test_jsonl_parquet_and_datasets_give_the_same_rows_and_name_them_alike(tmp_path):
    files = _tables(tmp_path, ROWS)
    fmt = RowFormat("rows", "a row is an object")
    for kind, path in files.items():
        got = list(iter_rows(path, fmt))
        assert [obj for _, obj in got] == ROWS, kind
        # lines counted from 1 (a blank line after each row), table rows from 0 across row groups and files
        assert [str(w) for w, _ in got] == ([f"{path}:{n}" for n in (1, 3, 5)] if kind == "jsonl" else
                                            [f"{path}:row {n}" for n in range(3)]), kind
    want = [(r["prompt"], r["completion"]) for r in ROWS]
    for kind, path in files.items():
        assert [(r.prompt, r.completion) for r in read_rows(path)] == want, kind
        assert [(r.prompt, r.references) for r in read_completion_rows(path)] == [(p, (c,)) for p, c in want], kind
        assert read_lambada_texts(path) == [r["text"] for r in ROWS], kind


@pytest.mark.needs_package("pyarrow", "datasets")
@pytest.mark.parametrize("consumer", ["finetune", "generate", "lambada"])
def test_a_bad_table_row_is_named_by_its_row_from_0(tmp_path, consumer):
    read, _, _, holds = CONSUMERS[consumer]
    rows = [dict(r) for r in ROWS]
    rows[2].update(prompt=None, text="  ")  # no prompt, no text: a fault for every consumer
    for kind, path in _tables(tmp_path, rows).items():
        with pytest.raises(UserError) as info:
            read(path)
        where = f"{path}:5: " if kind == "jsonl" else f"{path}:row 2: "
        text = str(info.value)
        assert text.startswith(where) and holds in text and "\n" not in text, (kind, text)
