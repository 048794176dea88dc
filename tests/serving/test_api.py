"""The OpenAI-compatible server through the official `openai` client against a real uvicorn server: outputs equal
`jm.generate`, usage counts, stop strings, n, logprobs, vLLM's extras, errors, API keys, disconnects, metrics,
engine failures, capacity, and the `jaxmodels serve` command."""
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

import jaxmodels as jm
from serving.api import build_app
from serving.engine import Engine
from tests.serving.conftest import ENGINE, MAX_MODEL_LEN, NAME, serve

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
N = 16
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    """Prompt ids and jm.generate's greedy tokens + text, for the plain prompt and the templated chat."""
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    out = {}
    for key, ids in (("completion", tokenizer.encode(PROMPT)), ("chat", chat_ids)):
        g = jm.generate(model, [ids], max_new_tokens=N, ignore_eos=True)
        out[key] = (ids, g.tokens[0], g.texts[0])
    return out


def post(served, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(served.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120, **kw)


def scrape(served) -> dict:
    """{(name, labels): value} of every sample /metrics exposes."""
    text = requests.get(served.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ----------------------------------------------------------------------------------------------- outputs
def test_models_and_health(client, served):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert requests.get(served.url + "/health", timeout=10).json() == {"status": "ok"}


def test_completion_equals_generate(client, served, reference):
    ids, tokens, text = reference["completion"]
    for prompt in (PROMPT, ids):  # text, then the same prompt as token ids
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=N, **GREEDY)
        (choice,) = r.choices
        assert (choice.text, choice.finish_reason) == (text, "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), N, len(ids) + N)
    served.wait_idle()


def test_completion_stream(client, served, reference):
    ids, _, text = reference["completion"]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *deltas, last = chunks
    assert len(deltas) > 1 and "".join(c.choices[0].text for c in deltas) == text
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), N)
    served.wait_idle()


def test_chat_equals_generate(client, reference):
    ids, _, text = reference["chat"]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=N, **GREEDY)
    msg = r.choices[0].message
    assert (msg.role, msg.content, r.choices[0].finish_reason) == ("assistant", text, "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), N)


def test_chat_stream(client, served, reference):
    ids, _, text = reference["chat"]
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=N, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    first, *deltas, last = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == text
    assert deltas[-1].choices[0].finish_reason == "length" and last.usage.completion_tokens == N
    assert last.usage.prompt_tokens == len(ids)
    served.wait_idle()


def test_stop_strings_cut_the_text(client, reference, tokenizer):
    _, tokens, text = reference["completion"]
    stop = tokenizer.decode(tokens[5:7])  # two tokens from the middle: it first appears at or before them
    assert stop.strip() and 0 < text.index(stop)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, stop=[stop, "never appears"], **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:text.index(stop)], "stop")
    assert r.usage.completion_tokens < N
    _, _, chat_text = reference["chat"]
    stop = chat_text[len(chat_text) // 2:][:3]
    chunks = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=N, stop=stop, stream=True, **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == chat_text[:chat_text.index(stop)]  # not even a prefix of the stop string got out


def test_n_with_seed_is_reproducible(client, served):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, extra_body={"ignore_eos": True})
    a, b = (client.completions.create(seed=1234, **kw) for _ in range(2))
    assert [c.index for c in a.choices] == [0, 1] and a.usage.completion_tokens == 16
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # two samples, not one twice
    other = client.completions.create(seed=99, **kw)
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    # chat, streamed: both choices arrive, each as its own index
    chunks = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=1.0, n=2, seed=7,
                                            stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(texts.values()) and texts[0] != texts[1]
    served.wait_idle()


def test_logprobs(client, model, reference):
    ids, tokens, _ = reference["completion"]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen) and top[tok] == pytest.approx(chosen)
    logits = jm.forward(model, np.asarray([ids], np.int32))[0, -1]
    assert lp.token_logprobs[0] == pytest.approx(float(jax.nn.log_softmax(logits)[tokens[0]]), abs=1e-4)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def test_vllm_extras_and_penalties(client, reference, tokenizer):
    _, tokens, text = reference["completion"]
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # sampling that keeps only the most likely token is greedy
        r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True, **extra})
        assert r.choices[0].text == text, extra
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"stop_token_ids": [tokens[3]]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (tokenizer.decode(tokens[:3]), "stop")
    assert len(set(tokens)) < len(tokens)  # greedy repeats a token; penalties of 2 + 2 must prevent that
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, presence_penalty=2.0, frequency_penalty=2.0,
                                  logprobs=0, **GREEDY)
    chosen = r.choices[0].logprobs.tokens
    assert len(chosen) == N and len(set(chosen)) == N


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", "{not json", 400, None, "JSON"),
    ("/v1/completions", "[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": -1}, 400, "max_tokens", "greater than"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": NAME, "prompt": "a " * 200}, 400, "prompt", "max_model_len"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 10**6]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"model": NAME, "prompt": []}, 400, "prompt", "at least 1"),
    ("/v1/completions", {"model": NAME, "prompt": [[1, 2], [-1]]}, 400, "prompt", "greater than"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "temperature": -1}, 400, "temperature", "greater than"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "top_p": 0}, 400, "top_p", "greater than"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "logprobs": 21}, 400, "logprobs", "less than"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "stop": [""]}, 400, "stop", "at least 1"),
    ("/v1/completions", {"model": NAME, "prompt": ["a"] * 40, "n": 100}, 400, "n", "at most"),
    ("/v1/completions", {"prompt": "a"}, 400, "model", "required"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi " * 200}]}, 400,
     "messages", "max_model_len"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]", "takes no images"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role", "user"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "greater than"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
])
def test_bad_requests_name_the_problem(served, path, body, status, param, words):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param) and words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_bad_request_through_the_client(client, served):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"
    assert requests.get(served.url + "/v1/nothing-here", timeout=10).status_code == 404
    served.wait_idle()


def test_api_key(model):
    with serve(build_app(Engine(model, ENGINE), NAME, api_key="sk-secret")) as url:  # the same shapes: no compile
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-secret"}):
            r = requests.get(url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        r = requests.post(url + "/v1/completions", json={"model": NAME, "prompt": "a"}, timeout=10)
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sk-secret", max_retries=0)
        assert ok.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        assert requests.get(url + "/health", timeout=10).status_code == 200  # probes need no key
        assert requests.get(url + "/metrics", timeout=10).status_code == 200


# ------------------------------------------------------------------------------- disconnects and failures
@pytest.fixture
def slow_steps(served, monkeypatch):
    """Engine steps of >= 50 ms, so that a request is surely still running when the test acts on it."""
    step = served.engine.step

    def slow():
        time.sleep(0.05)
        return step()
    monkeypatch.setattr(served.engine, "step", slow)


def _finished(served, reason: str) -> float:
    return scrape(served).get(("jaxmodels_requests_finished_total", (("finish_reason", reason),)), 0.0)


def test_disconnect_mid_stream_frees_blocks(served, slow_steps):
    aborted = _finished(served, "abort")
    conn = http.client.HTTPConnection("127.0.0.1", int(served.url.rsplit(":", 1)[1]), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 100,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")  # generating, for > 5 s more
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    served.wait_idle(timeout=5)  # 100 tokens would take > 5 s
    assert _finished(served, "abort") == aborted + 1


def test_disconnect_before_the_answer_frees_blocks(served, slow_steps):
    aborted = _finished(served, "abort")
    body = json.dumps({"model": NAME, "messages": CHAT, "max_tokens": 90, "ignore_eos": True, "n": 2}).encode()
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while served.loop.stats["running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    served.wait_idle(timeout=5)
    assert _finished(served, "abort") == aborted + 2


def test_engine_failure_fails_its_requests_and_the_server_goes_on(client, served, monkeypatch):
    step, calls = served.engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return step()
    monkeypatch.setattr(served.engine, "step", failing_once)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
    assert "injected fault" in e.value.body["message"] and e.value.body["type"] == "server_error"
    served.wait_idle()
    calls.clear()
    with pytest.raises(openai.APIError, match="injected fault"):  # streaming: an error event, then the end
        list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, stream=True))
    served.wait_idle()
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
    assert r.usage.completion_tokens >= 1 and requests.get(served.url + "/health", timeout=10).status_code == 200
    served.wait_idle()


def test_over_capacity_is_429(client, served, slow_steps, monkeypatch):
    monkeypatch.setattr(served.loop, "capacity", 2)
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=50, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
    assert e.value.response.headers["Retry-After"] == "1"
    stream.close()
    served.wait_idle(timeout=5)
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).choices[0].text


# ----------------------------------------------------------------------------------------------- metrics
def test_metrics(client, served, tokenizer):
    prompt = " ".join(f"w{i}" for i in range(40))  # > 2 blocks of 16 tokens: the second request hits the cache
    ids = tokenizer.encode(prompt)
    before = scrape(served)
    for _ in range(2):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=5, **GREEDY)
    served.wait_idle()
    after = scrape(served)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)
    assert delta("jaxmodels_prompt_tokens_total") == 2 * len(ids)
    assert delta("jaxmodels_generation_tokens_total") == 10
    assert delta("jaxmodels_cached_prompt_tokens_total") >= 32
    assert delta("jaxmodels_requests_finished_total", finish_reason="length") == 2
    assert delta("jaxmodels_time_to_first_token_seconds_count") == 2
    assert delta("jaxmodels_inter_token_latency_seconds_count") == 8
    assert 0 < delta("jaxmodels_inter_token_latency_seconds_sum") < delta("jaxmodels_e2e_request_latency_seconds_sum")
    assert 0 < after[("jaxmodels_prefix_cache_hit_rate", (("group", "full"),))] <= 1
    assert after[("jaxmodels_kv_blocks_used", (("group", "full"),))] == 0
    assert after[("jaxmodels_kv_blocks_total", ())] == ENGINE.kv_blocks
    assert after[("jaxmodels_num_requests_running", ())] == after[("jaxmodels_num_requests_waiting", ())] == 0


# --------------------------------------------------------------------------------------------------- CLI
def test_serve_command(model, tokenizer, tmp_path, reference):
    """The command end to end, sharded over the test's 8 CPU devices (--mesh): the completion is jm.generate's."""
    from converters.orbax_io import save

    path = save(tmp_path / "tiny", model.config, model.params, tokenizer)
    cmd = [sys.executable, "-m", "jaxmodels.cli", "serve", "--model", str(path), "--port", "0", "--max-num-seqs",
           "2", "--max-model-len", "64", "--kv-blocks", "8", "--served-model-name", "cli-model", "--api-key", "k",
           "--mesh", "data=4,tensor=2", "--warmup", "greedy"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # its address, announced once the model is loaded
            lines.append(line)
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
                break
        assert m, "".join(lines)
        rest = []
        drain = threading.Thread(target=lambda: rest.append(proc.stderr.read()), daemon=True)  # no full pipe
        drain.start()
        url = m.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        r = c.completions.create(model="cli-model", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].text
        want = reference["completion"][1][:3]
        assert r.choices[0].logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in want]
    finally:
        proc.terminate()
    # uvicorn shuts down gracefully (the app's lifespan stops the engine thread), then re-raises the SIGTERM
    assert proc.wait(30) == -15
    drain.join(10)
    assert "Application shutdown complete" in rest[0] and "Traceback" not in rest[0], rest
    assert re.search(r"warm-up: \d+ programs compiled", "".join(lines)), lines  # before the address


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxmodels.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_serve_bad_arguments_are_one_line(tmp_path):
    r = _cli("--model", str(tmp_path), "--max-num-seqs", "0")
    assert (r.returncode, r.stderr) == (2, "jaxmodels serve: error: --max-num-seqs must be an int >= 1, got 0\n")
    r = _cli("--model", str(tmp_path / "missing"), "--port", "0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:
        r = _cli("--model", str(tmp_path), "--port", str(taken.getsockname()[1]))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "in use" in r.stderr, r.stderr
    r = _cli("--model", str(tmp_path), "--port", "70000")
    assert r.returncode == 2 and r.stderr == "jaxmodels serve: error: --port must be in [0, 65535], got 70000\n"
    r = _cli("--model", str(tmp_path), "--warmup", "greedy,fast")
    assert r.returncode == 2 and r.stderr == ("jaxmodels serve: error: --warmup takes 'none' or a comma-separated "
                                              "list of greedy, sampled, filtered, got 'greedy,fast'\n"), r.stderr
    r = _cli("--model", str(tmp_path), "--bogus")
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == "jaxmodels: error: unrecognized arguments: --bogus"
    assert "Traceback" not in r.stderr
    r = _cli("--model", str(tmp_path), "--gpu-memory-utilization", "1.5")
    assert r.stderr == "jaxmodels serve: error: --gpu-memory-utilization must be in (0, 1], got 1.5\n"
    r = _cli("--model", str(tmp_path), "--mesh", "data=3")
    assert r.returncode == 2 and r.stderr == "jaxmodels serve: error: mesh {'data': 3} needs 3 devices, 8 available\n"
    r = _cli("--model", str(tmp_path), "--mesh", "tensor=8", "--rules", "nope")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown sharding preset 'nope'" in r.stderr


def test_serve_memory_fraction_needs_a_device_that_reports_memory(model, tokenizer, tmp_path):
    from converters.orbax_io import save

    path = save(tmp_path / "tiny", model.config, model.params, tokenizer)
    r = _cli("--model", str(path), "--port", "0", "--gpu-memory-utilization", "0.5")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cpu:0 reports no memory statistics, so memory_fraction cannot size the KV cache; pass kv_blocks" \
        in r.stderr
