"""What a request asks for (SamplingParams), its state inside the engine (Request), and what comes out."""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top_logprobs per token, as OpenAI's API caps it


def _number(name, value, ok, want):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _integer(name, value, ok, want):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as vLLM names it. temperature 0 = greedy; top_k 0 / top_p 1 / min_p 0 = off.
    max_tokens None: up to the engine's max_model_len. logprobs: None, or how many top alternatives to return
    per token (0: only the chosen token's). seed: reproducible sampling whatever else the engine runs."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _integer("n", self.n, lambda v: v >= 1, "an int >= 1")
        _number("temperature", self.temperature, lambda v: 0 <= v < math.inf, "a finite number >= 0")
        _number("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _integer("top_k", self.top_k, lambda v: v >= 0 or v == -1, "an int >= 0 (0 or -1: off)")
        _number("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.seed is not None:
            _integer("seed", self.seed, lambda v: 0 <= v < 2**32, "an int in [0, 2**32)")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, lambda v: v >= 1, "an int >= 1")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, lambda v: v >= 0, "ints >= 0")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lambda v: 0 <= v <= MAX_LOGPROBS, f"an int in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, best first


@dataclass
class StepOutput:
    """What one engine step adds to one request (streaming deltas)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    logprobs: list[Logprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass(eq=False)  # identity: the scheduler's lists and the engine's batches compare requests by `is`
class Request:
    """A request inside the engine. tokens = prompt + output (the generated tokens the host knows).

    computed: positions whose KV the device has been asked to write (advanced when a step is scheduled, so with
    asynchronous scheduling it runs ahead of what has come back); pending: tokens sampled by steps in flight whose
    ids the host has not read yet."""

    id: str
    prompt: list[int]
    params: SamplingParams
    eos: frozenset
    seed: int = 0  # the sampling seed (params.seed, or drawn at arrival)
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    generated: int = 0  # tokens sampled and read back, a final EOS / stop id included
    pending: int = 0  # tokens sampled by steps in flight, not read back yet
    computed: int = 0
    cached: int = 0  # prompt tokens served by the prefix cache (latest admission)
    blocks: object = None  # kv_pool.SeqBlocks while admitted
    row: int = -1
    detok: object = None
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    first_token_time: float | None = None
    preemptions: int = 0
    features: object = None  # a vision model's image-token embeddings [image tokens, D], in prompt order
    salt: bytes = b""  # the images' digest: prefix-cache blocks are shared only with the same images
    spans: tuple = ()  # (start, end) of image-token runs a prefill chunk must not split (Gemma3)
    # Mllama: its processed images, padded to the engine's image slots, and each prompt token's tile mask; every
    # prefill chunk of the request passes them to the cross-attention layers, decode reads their kept K/V
    cross: dict | None = None
    digests: list = field(default_factory=list)  # chain digest of each full block of tokens (kept across admissions)
    draft: int = 0  # speculative decoding: tokens drafted per decode step (0: plain decoding)
    draws: int = 0  # random keys used so far (a sample 1, a verify step k + 1): the next key's index for its seed
    tokens: list[int] = field(init=False)

    def __post_init__(self):
        self.tokens = self.prompt + self.output

    def verifies(self, start: int, n: int) -> bool:
        """Whether the piece of n tokens at `start` is a speculative decode step: the request drafts and the piece
        is its last known token, a generated one (a prompt's tokens run as chunks, which the drafter follows)."""
        return bool(self.draft) and n == 1 and len(self.prompt) <= start == len(self.tokens) + self.pending - 1

    def append(self, token: int) -> None:
        self.output.append(token)
        self.tokens.append(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
