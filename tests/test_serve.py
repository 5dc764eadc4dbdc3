"""``tnlg serve`` through OpenAI's own Python client: served tokens against transformers' ``generate`` and ``tnlg
generate`` at TP 1 and TP 2, streamed and not; concurrent clients each answered as if alone; the queue's 429;
OpenAI's error objects for bad requests, after which the server still serves; a client leaving mid-stream;
the refusals before any process starts (a port in use, a non-loopback host); SIGTERM and Ctrl-C.

The servers are real processes (``python -m tnlg serve --port 0``, the address read from the line it prints);
the queue and the request checks also run in-process on the app alone (no model: nothing consumes the queue).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.hf_reference import random_gpt2
from tests.served import Server
from tnlg.cli import main

pytestmark = pytest.mark.needs_package("fastapi", "uvicorn", "openai")

SEQ = 64
PROMPTS = ["To be, or not to be", "Of man's first disobedience, and the fruit", "Sing"]


@pytest.fixture(scope="module")
def tokenizer():
    from tnlg.data.tokenizer import load_tokenizer
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tokenizer):
    """A random GPT-2 folder over the built-in SentencePiece model's 4096 ids, 64 positions."""
    folder = tmp_path_factory.mktemp("served")
    eod = tokenizer.eod_id
    hf = random_gpt2(4096, SEQ, 3, n_embd=32, n_head=4, n_layer=2, bos_token_id=eod, eos_token_id=eod, pad_token_id=0)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def server(hf_folder):
    s = Server(hf_folder[0], "--max-batch", "4", "--max-queue", "32")
    yield s
    if s.proc.poll() is None:
        s.stop()


@torch.no_grad()
def hf_greedy(hf, ids, new, eod):
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eod)
    out = out[0, len(ids):].tolist()
    return out[:out.index(eod) + 1] if eod in out else out


def completion_ids(client, prompt, stream=False, **kw):
    """(token ids, text, finish reason) of one completion, streamed or not."""
    kw.setdefault("extra_body", {})["return_token_ids"] = True
    if not stream:
        r = client.completions.create(model="served", prompt=prompt, **kw)
        c = r.choices[0]
        return c.token_ids, c.text, c.finish_reason
    ids, text, finish = [], "", None
    for chunk in client.completions.create(model="served", prompt=prompt, stream=True, **kw):
        c = chunk.choices[0]
        ids += getattr(c, "token_ids", None) or []
        text += c.text
        finish = c.finish_reason or finish
    return ids, text, finish


def generate_json(folder, *argv):
    from io import StringIO
    from contextlib import redirect_stdout
    out = StringIO()
    with redirect_stdout(out):
        assert main(["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--json", *argv]) == 0
    return json.loads(out.getvalue())["results"]


def _check_against_references(server, hf_folder, tokenizer):
    folder, hf = hf_folder
    client = server.client()
    eod = tokenizer.eod_id
    greedy = generate_json(folder, *sum((["--prompt", p] for p in PROMPTS), []), "--greedy", "--max-new-tokens", "10")
    for p, ours in zip(PROMPTS, greedy):
        want = hf_greedy(hf, tokenizer.encode(p), 10, eod)
        assert ours["tokens"] == want
        for stream in (False, True):
            ids, text, finish = completion_ids(client, p, stream, max_tokens=10, temperature=0)
            assert ids == want, (p, stream)
            assert text == ours["text"]
            assert finish == ("stop" if want[-1] == eod else "length")
    # seeded sampling: the request's seed is `tnlg generate --seed` for its prompt alone
    sampled = generate_json(folder, "--prompt", PROMPTS[0], "--top-k", "8", "--temperature", "0.9", "--seed", "11",
                            "--max-new-tokens", "9")[0]
    for stream in (False, True):
        ids, _, _ = completion_ids(client, PROMPTS[0], stream, max_tokens=9, temperature=0.9, seed=11,
                                   extra_body={"top_k": 8})
        assert ids == sampled["tokens"]
    # a chat turn: the built-in template's prompt (one text up to "<|assistant|>\n"), greedy
    ids = tokenizer.encode("<|user|>\nhow are you?\n<|assistant|>\n")
    want = hf_greedy(hf, ids, 8, eod)
    r = client.chat.completions.create(model="served", messages=[{"role": "user", "content": "how are you?"}],
                                       max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.content == tokenizer.decode(ids + [t for t in want if t != eod])[
        len(tokenizer.decode(ids)):]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "how are you?"}], max_tokens=8, temperature=0,
        stream=True) if c.choices)
    assert streamed == r.choices[0].message.content


def test_served_tokens_equal_transformers_and_tnlg_generate(server, hf_folder, tokenizer):
    _check_against_references(server, hf_folder, tokenizer)
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["served"]
    # n choices: choice i draws from seed + i
    r = client.completions.create(model="served", prompt=PROMPTS[1], n=2, max_tokens=6,
                                  temperature=1.0, seed=4, extra_body={"return_token_ids": True})
    alone = completion_ids(client, PROMPTS[1], max_tokens=6, temperature=1.0, seed=5)[0]
    assert [c.index for c in r.choices] == [0, 1] and r.choices[1].token_ids == alone
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[1]))
    # stop strings: the greedy text cut before the first stop string
    full = completion_ids(client, PROMPTS[0], max_tokens=12, temperature=0)[1]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    for stream in (False, True):
        _, text, finish = completion_ids(client, PROMPTS[0], stream, max_tokens=12, temperature=0, stop=[stop])
        assert text == full[:full.index(stop)] and finish == "stop"
    # logprobs: the model's log-softmax, checked against transformers' logits
    r = client.completions.create(model="served", prompt=PROMPTS[2], max_tokens=3,
                                  temperature=0, logprobs=2, extra_body={"return_token_ids": True})
    ids = tokenizer.encode(PROMPTS[2]) + r.choices[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf_folder[1](torch.tensor([ids])).logits[0].double(), -1)
    n = len(tokenizer.encode(PROMPTS[2]))
    for j, t in enumerate(r.choices[0].token_ids):
        assert r.choices[0].logprobs.token_logprobs[j] == pytest.approx(float(logp[n - 1 + j, t]), abs=1e-4)
        assert max(r.choices[0].logprobs.top_logprobs[j].values()) == pytest.approx(
            float(logp[n - 1 + j].max()), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")])
def test_served_tokens_equal_the_references_at_tp2_and_pp2(hf_folder, tokenizer, layout):
    s = Server(hf_folder[0], *layout)
    try:
        assert ("TP 2 x PP 1" if layout[0] == "--tp" else "TP 1 x PP 2") in s.lines[-1]
        _check_against_references(s, hf_folder, tokenizer)
    finally:
        code, err = s.stop()
    assert code == 128 + signal.SIGTERM and "stopped (SIGTERM)" in err, err


def test_concurrent_clients_each_get_what_they_get_alone(server):
    """16 clients at once on 4 rows (requests wait, join the batch between steps, prompts prefilled beside
    other rows' decode steps): each answer equals the same request's answer served alone."""
    client = server.client(timeout=120)
    words = "the quick brown fox jumps over the lazy dog and then some more words follow here".split()
    requests = []
    for i in range(16):
        prompt = " ".join(words[:1 + (5 * i) % len(words)])
        kw = dict(max_tokens=4 + i % 9, temperature=0) if i % 2 else dict(max_tokens=3 + i % 7, temperature=0.8,
                                                                           seed=i, top_p=0.9)
        requests.append((prompt, bool(i % 3 == 0), kw))
    alone = [completion_ids(client, p, False, **dict(kw)) for p, _, kw in requests]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda r: completion_ids(client, r[0], r[1], **dict(r[2])), requests))
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert [t[1] for t in together] == [a[1] for a in alone]
    import httpx
    health = httpx.get(server.url + "/health").json()
    assert health["running"] == health["waiting"] == 0 and health["served"] >= 32


def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(server):
    import httpx
    import openai
    client = server.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="served", prompt="word " * 80)
    assert "maximum context length is 64 tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="served", prompt="hi", max_tokens=100)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="served", prompt="hi", temperature=5)
    raw = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    # a client leaving mid-stream: its rows are freed, the server goes on
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "Sing", "max_tokens": 40, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").json()["running"] == 0
    assert completion_ids(client, "Sing", max_tokens=3, temperature=0)[2] in ("length", "stop")
    assert server.proc.poll() is None


# ----------------------------------------------------------------------------- the app alone (no model)

@pytest.fixture
def app_alone(tokenizer):
    from starlette.testclient import TestClient

    from tnlg.serving.app import make_app
    from tnlg.serving.protocol import ModelLimits
    from tnlg.serving.scheduler import Scheduler
    scheduler = Scheduler(tokenizer, max_batch=2, max_queue=2, seq_length=SEQ)
    app = make_app(scheduler, ModelLimits("m", SEQ, tokenizer.vocab_size, 2), tokenizer)
    with TestClient(app) as client:
        yield scheduler, client


def test_queue_bound_answers_429_and_stopping_503(app_alone, tokenizer):
    from tnlg.serving.protocol import ModelLimits, parse_completion
    scheduler, client = app_alone
    req = parse_completion({"prompt": "hi"}, ModelLimits("m", SEQ, tokenizer.vocab_size, 2), tokenizer)
    for _ in range(2):  # nothing takes them: the engine loop does not run here
        scheduler.submit(req, lambda e: None)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "--max-queue" in r.json()["error"]["message"]
    scheduler.stop()
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and set(r.json()) == {"error"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/v1/completions", {"prompt": "word " * 70}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 64}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 9}, 400,
     "top_logprobs"),
])
def test_bad_fields_are_openai_errors(app_alone, path, body, status, param):
    _, client = app_alone
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_unknown_paths_and_malformed_bodies_have_the_error_shape(app_alone):
    _, client = app_alone
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.post("/v1/chat/completions", content=b"\xff\xfe")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert client.get("/health").json()["status"] == "ok"
    assert "<title>tnlg chat</title>" in client.get("/").text


# ----------------------------------------------------------------------------- refusals, signals

def test_a_port_in_use_and_a_remote_host_are_refused_before_loading(hf_folder, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--checkpoint", str(hf_folder[0]), "--tokenizer-model", "builtin",
                     "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port 0" in err
    assert main(["serve", "--checkpoint", str(hf_folder[0]), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "every network interface" in err and "--allow-remote" in err and "without a password" in err


def test_ctrl_c_stops_the_server_cleanly(hf_folder):
    s = Server(hf_folder[0])
    client = s.client()
    assert completion_ids(client, "Sing", max_tokens=2, temperature=0)[0]
    code, err = s.stop(signal.SIGINT)
    assert code == 0 and "stopped (SIGINT); served 1 requests" in err, err
    assert "Traceback" not in err


def test_a_llama_folder_is_served_as_transformers_generates(tmp_path, tokenizer):
    """Grouped-query attention and rope through the per-row cache: served greedy tokens of a random Llama equal
    transformers' greedy ``generate``, streamed and not, requests sharing the batch."""
    from tests.llama_reference import random_llama
    eod = tokenizer.eod_id
    hf = random_llama(vocab=4096, seq=SEQ, seed=1, bos_token_id=eod, eos_token_id=eod)
    hf.save_pretrained(tmp_path / "llama")
    s = Server(tmp_path / "llama")
    try:
        client = s.client()
        want = [hf_greedy(hf, tokenizer.encode(p), 8, eod) for p in PROMPTS]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda a: completion_ids(client, a[0], a[1], max_tokens=8, temperature=0)[0],
                                [(p, stream) for p in PROMPTS for stream in (False, True)]))
        assert got == [w for w in want for _ in (0, 1)]
    finally:
        s.stop()


def test_a_long_prompt_joining_rows_near_the_end_is_prefilled_in_chunks(hf_folder, tokenizer):
    """In-process, the scheduler and the engine stepped by hand: a 40-token prompt arrives while another row is 50
    positions in (of 64), so only the positions that row has left fit in a step; the prompt is fed over several
    steps beside that row's decode tokens, and both sequences are what they are alone (transformers' greedy)."""
    from tnlg.interop.hf import from_hf
    from tnlg.serving.engine import StepEngine
    from tnlg.serving.protocol import ModelLimits, parse_completion
    from tnlg.serving.scheduler import Scheduler
    folder, hf = hf_folder
    model = from_hf(str(folder)).eval()
    limits = ModelLimits("m", SEQ, tokenizer.vocab_size, 2)
    scheduler, engine = Scheduler(tokenizer, 2, 4, SEQ), StepEngine(model, 2, tokenizer.vocab_size)
    events: dict[str, list] = {"a": [], "b": []}
    a = list(range(100, 110))
    b = list(range(200, 240))
    scheduler.submit(parse_completion({"prompt": a, "max_tokens": 54, "temperature": 0}, limits, tokenizer),
                     events["a"].append)
    widths = []

    def step():
        plan = scheduler.next_plan(idle_s=0.01)
        widths.append(max(map(len, plan.feeds)) if plan.feeds else 0)
        if plan.feeds:
            scheduler.deliver(engine.step(plan))
    while len(events["a"]) < 41:  # row a at 10 + 40 positions
        step()
    scheduler.submit(parse_completion({"prompt": b, "max_tokens": 6, "temperature": 0}, limits, tokenizer),
                     events["b"].append)
    for _ in range(200):
        if all(any(e.kind == "done" for e in ev) for ev in events.values()):
            break
        step()
    got = {k: [t for e in ev for t in e.token_ids] for k, ev in events.items()}
    assert got["a"] == hf_greedy(hf, a, 54, tokenizer.eod_id)
    assert got["b"] == hf_greedy(hf, b, 6, tokenizer.eod_id)
    chunks = [w for w in widths[42:] if w > 1]
    assert len(chunks) > 1 and max(chunks) < len(b), widths  # fed over several steps, none the whole prompt
