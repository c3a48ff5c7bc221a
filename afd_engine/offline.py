"""The offline API shared by the in-process engine and multi-rank deployments."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tqdm import tqdm

from afd_engine.errors import InvalidRequestError
from afd_engine.runtime.request import RequestOutput
from afd_engine.sampling_params import SamplingParams


class OfflineEngine(ABC):
    """What every engine offers offline: `generate` on top of `add_request`, `step` and
    `has_unfinished`; `abort`; `close` (also as a context manager)."""

    @abstractmethod
    def add_request(self, prompt=None, params=None, prompt_token_ids=None, request_id=None) -> str:
        """Queues one request: `prompt` (str) or `prompt_token_ids` (list[int]), `params`
        (SamplingParams; None: the defaults), an optional `request_id` (str); returns its
        id. Raises InvalidRequestError (and queues nothing) if it cannot run."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Advances the requests; returns those that finished."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def abort(self, request_id: str) -> RequestOutput | None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[str] | str | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A request that cannot run (too long, empty) gets finish_reason "error" and its message;
        the others are unaffected.
        """
        inputs = _inputs(prompts, prompt_token_ids)
        params = _params(sampling_params, len(inputs))
        results: dict[int, RequestOutput] = {}
        index: dict[str, int] = {}
        for i, (inp, p) in enumerate(zip(inputs, params)):
            try:
                rid = self.add_request(**inp, params=p)
                index[rid] = i
            except InvalidRequestError as exc:
                results[i] = RequestOutput(f"invalid-{i}", inp.get("prompt_token_ids") or [], [], "", "error", str(exc))
        bar = tqdm(total=len(index), desc="generate", disable=not use_tqdm)
        while self.has_unfinished():
            for out in self.step():
                results[index[out.request_id]] = out
                bar.update(1)
        bar.close()
        return [results[i] for i in range(len(inputs))]


def _inputs(prompts, prompt_token_ids) -> list[dict]:
    if (prompts is None) == (prompt_token_ids is None):
        raise InvalidRequestError("give exactly one of prompts and prompt_token_ids", param="prompts")
    if prompts is not None:
        return [{"prompt": p} for p in ([prompts] if isinstance(prompts, str) else prompts)]
    return [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]


def _params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts", param="sampling_params")
    return params
