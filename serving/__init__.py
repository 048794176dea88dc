"""Serving: a paged-KV engine with continuous batching and prefix caching, an offline `LLM` API, and an
OpenAI-compatible HTTP server (`jaxmodels serve`)."""
from serving.engine import Engine, EngineConfig
from serving.llm import LLM
from serving.request import CompletionOutput, RequestOutput, SamplingParams, StepOutput

__all__ = ["Engine", "EngineConfig", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StepOutput"]
