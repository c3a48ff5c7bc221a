"""What the routes share: the engine client, the tokenizer and the server's settings."""

from __future__ import annotations

from dataclasses import dataclass

from afd_engine.control.client import ControlClient
from afd_engine.server.logprobs import LogprobFormatter
from afd_engine.server.metrics import ServerMetrics


@dataclass
class ServerState:
    client: ControlClient
    tokenizer: object
    model_name: str
    context_len: int
    default_max_tokens: int
    metrics: ServerMetrics
    logprob_format: LogprobFormatter
    max_prompt_chars: int
    sampling_defaults: dict  # temperature / top_p / top_k from the model's generation_config.json
    vocab_size: int = 0  # the model's (logit_bias ids must be below it)
    tool_call_parser: str = "deepseekv3"  # server/tool_calls/registry.py's PARSERS
    disaggregation_mode: str = "null"
    bootstrap_port: int | None = None  # a prefill instance's bootstrap server
