"""256 concurrent streaming requests (openai.AsyncOpenAI), completions and chat, against the live server: none
fails, each streams what it streams alone (greedy: batching must not change a token), the engine really batched
them, and afterwards every block is free and /health is OK.

Greedy, because a sampled step of 32 rows takes ~0.9 s on this CPU against ~10 ms greedy (the runner sorts the whole
vocabulary); seeded sampling is covered in test_api."""
import asyncio
import time

import openai
import requests

from tests.serving.conftest import NAME

REQUESTS = 256
MAX_TOKENS = 8
PROMPTS = [f"Request number {i} says" for i in range(6)]  # short: one 16-token chunk each
CHATS = [[{"role": "user", "content": "Count to three."}], [{"role": "user", "content": "Say hi."}]]
ARGS = {"max_tokens": MAX_TOKENS, "temperature": 0}


def _request(i: int) -> tuple[str, dict]:
    """Every fourth request is a chat."""
    if i % 4 == 3:
        return "chat", {"messages": CHATS[i // 4 % len(CHATS)]}
    return "completion", {"prompt": PROMPTS[i % len(PROMPTS)]}


async def _one(client, i: int) -> tuple[str, str, int]:
    kind, body = _request(i)
    api = client.chat.completions if kind == "chat" else client.completions
    stream = await api.create(model=NAME, stream=True, stream_options={"include_usage": True},
                              extra_body={"ignore_eos": True}, **ARGS, **body)
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += (c.delta.content or "") if kind == "chat" else c.text
            finish = c.finish_reason or finish
    return text, finish, usage


async def _all(url: str):
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(REQUESTS)), return_exceptions=True)


def test_256_concurrent_streams(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    alone = {}
    for i in range(REQUESTS):
        kind, body = _request(i)
        if repr(body) not in alone:
            r = (client.chat.completions if kind == "chat" else client.completions).create(
                model=NAME, extra_body={"ignore_eos": True}, **ARGS, **body)
            alone[repr(body)] = r.choices[0].message.content if kind == "chat" else r.choices[0].text
    assert len(set(alone.values())) == len(alone)  # distinct prompts, distinct texts: a mix-up would show
    served.wait_idle()
    served.engine.history.clear()
    served.engine.record = True  # the engine thread is idle: safe to switch
    start = time.monotonic()
    try:
        results = asyncio.run(_all(served.url))
    finally:
        served.wait_idle()
        served.engine.record = False
    seconds = time.monotonic() - start
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {REQUESTS} failed, e.g. {errors[0]!r}"
    assert all((finish, usage) == ("length", MAX_TOKENS) for _, finish, usage in results)
    for i, (text, _, _) in enumerate(results):
        assert text == alone[repr(_request(i)[1])], i
    batched = max(len(step["ran"]) for step in served.engine.history)
    assert batched == served.engine.config.max_num_seqs, f"at most {batched} requests ran together"
    assert requests.get(served.url + "/health", timeout=10).json() == {"status": "ok"}
    print(f"{REQUESTS} streams in {seconds:.1f} s, up to {batched} per step")
