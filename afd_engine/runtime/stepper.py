"""Plans, runs and finishes the engine's forward steps, overlapping CPU work with the forward.

A step has three parts:

- plan (scheduling thread): the scheduler picks the step's requests, the runner builds its
  tensors, the plan is committed (its tokens count as cached) and each sampler gets a token
  "under way" (Request.inflight);
- execute (forward thread): the lockstep agreement round of a deployment's rank, the model's
  forward, and sampling;
- finish (scheduling thread): the sampled tokens are appended, logprobs recorded, stop conditions
  checked, finished requests removed and prefilled pages handed to the prefix cache.

With overlap (the default) the scheduling thread plans step n+1 and hands it to the forward
thread before it finishes step n, so both CPU parts run while a forward is under way; the way
SGLang's overlap scheduler hides them. Step n+1 is built before step n's tokens are known: a
decode whose input is one of them carries a placeholder that the forward thread replaces with
step n's samples (PreparedStep.resolve), with no round trip through the scheduler. A request
that step n finishes (EOS, a stop string) has already been planned into step n+1; that extra
token is computed and dropped. One that max_new_tokens or the context length ends is known to
end and is not planned again.

Steps whose requests score their prompt (prompt logprobs) run without overlap: which prompt
positions a step scores depends on what the previous step recorded.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from afd_engine.eplb.recorder import ExpertLoadRecorder
from afd_engine.runtime.logits_process import LogitControls
from afd_engine.runtime.model_runner import PreparedStep, Scored, StepRunner, commit
from afd_engine.runtime.request import Request, TokenLogprob
from afd_engine.runtime.sampler import Sampler, SamplingBatch
from afd_engine.runtime.scheduler import Scheduler
from afd_engine.runtime.stop_checker import StopChecker


@dataclass
class _Step:
    prepared: PreparedStep
    sampling: SamplingBatch | None
    controls: LogitControls | None = None  # grammars, penalties, bias, min_tokens of its samplers
    result: Future | None = None  # of (logits, sampled tokens, rows whose grammar ended), or None


class Stepper:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        stop_checker: StopChecker,
        load_recorder: ExpertLoadRecorder,
        context_len: int,
        vocab_size: int,
        overlap: bool = True,
    ) -> None:
        self.scheduler, self.runner, self.stop_checker = scheduler, runner, stop_checker
        self.load_recorder, self.context_len, self.vocab_size = load_recorder, context_len, vocab_size
        self.overlap = overlap
        self.sampler = Sampler()
        self._pending: _Step | None = None  # planned and handed to the forward thread, not finished
        self._previous_tokens: torch.Tensor | None = None  # forward thread only
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="forward") if overlap else None

    def step(self) -> tuple[list[Request], list[Request]]:
        """Runs one scheduling round; returns (requests that got a token, requests that finished)
        of the step finished in this round: with overlap, the one planned in the round before."""
        if not self.overlap or self.scheduler.scoring:
            sampled, done = self.drain()
            step, planned_done = self._plan()
            if step is not None:
                s, d = self._finish(step, self._execute(step))
                sampled, done = sampled + s, done + d
            return sampled, done + planned_done
        step, planned_done = self._plan()
        if step is not None:
            step.result = self._worker.submit(self._execute, step)
        previous, self._pending = self._pending, step
        if previous is None:
            return [], planned_done
        sampled, done = self._finish(previous, previous.result.result())
        return sampled, done + planned_done

    def drain(self) -> tuple[list[Request], list[Request]]:
        """Finishes the step under way, if any."""
        previous, self._pending = self._pending, None
        if previous is None:
            return [], []
        return self._finish(previous, previous.result.result())

    def close(self) -> None:
        if self._pending is not None:
            self._pending.result.exception()  # wait: the forward thread may still write the cache
            self._pending = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    # -- the three parts -------------------------------------------------------------------

    def _plan(self) -> tuple[_Step | None, list[Request]]:
        """(the step to run, or None when there is none this round; requests the scheduler ended)."""
        plan = self.scheduler.schedule()
        for req in plan.finished:
            self.scheduler.remove(req)
        if plan.empty and not self.runner.lockstep:
            return None, plan.finished
        prepared = self.runner.prepare(plan)
        samplers = prepared.inputs.samplers
        sampling, device = None, self.scheduler.pool.device
        params = [r.params for r in samplers]
        greedy = all(p.greedy for p in params)
        processed = any(p.processed for p in params)
        # index of the token each row samples within its request (seeded draws, min_tokens)
        offsets = [len(r.output_ids) + len(r.inflight) for r in samplers] if processed or not greedy else []
        if params and greedy:  # argmax only: no per-row settings
            sampling = SamplingBatch.greedy(device)
        elif params:
            sampling = SamplingBatch.build(params, [r.seed for r in samplers], offsets, self.vocab_size, device)
        controls = None
        if processed:
            controls = LogitControls.build(samplers, offsets, self.stop_checker.eos_token_ids, self.vocab_size, device)
        commit(plan)
        for row, req in enumerate(samplers):
            req.inflight.append(row)
        return _Step(prepared, sampling, controls), plan.finished

    @torch.inference_mode()
    def _execute(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The forward thread's part: None when the step does not run after all (a lockstep
        round in which no rank has work, or the agreed stop)."""
        if not self.runner.begin_step(step.prepared.plan):
            self._previous_tokens = None
            return None
        step.prepared.resolve(self._previous_tokens)
        logits = self.runner.execute(step.prepared)
        self.load_recorder.end_step()
        inputs, tokens, ended = step.prepared.inputs, None, []
        if inputs.samplers:
            sample_logits = logits[inputs.sample_rows] if inputs.scored else logits
            if step.controls is not None:
                sample_logits = step.controls.apply(sample_logits)
            tokens = self.sampler(sample_logits, step.sampling)
            if step.controls is not None:
                ended = step.controls.accept(tokens)
        self._previous_tokens = tokens
        return logits, tokens, ended

    def _finish(self, step: _Step, result) -> tuple[list[Request], list[Request]]:
        plan, inputs = step.prepared.plan, step.prepared.inputs
        for req in inputs.samplers:
            req.inflight.pop(0)
        if result is None:
            return [], []
        logits, tokens, ended = result
        done = []
        if inputs.scored:
            _record_prompt_logprobs(inputs.scored, logits)
        if inputs.samplers:
            sample_logits = logits[inputs.sample_rows] if inputs.scored else logits
            done += self._append_tokens(inputs.samplers, sample_logits, tokens, ended)
        return self._close(plan, inputs, done)

    def _close(self, plan, inputs, done: list[Request]) -> tuple[list[Request], list[Request]]:
        """The end of a step's finish: requests that only scored their prompt end, the finished
        ones leave the scheduler, prefilled pages go to the prefix cache; (sampled, finished)."""
        for req in inputs.scoring_done:  # scored its prompt, generates nothing
            if req.finish_reason is None:
                req.finish_reason = "length"
                done.append(req)
        for req in done:
            self.scheduler.remove(req)
        self.scheduler.step_done(plan)
        live = [r for r in inputs.samplers if r.finish_reason is None or r in done]
        return live, done

    def _append_tokens(
        self, reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor, grammar_ended: list[int]
    ) -> list[Request]:
        """Appends each live request's token; returns those that finish with it. A request that
        ended (or was aborted) while its token was under way takes nothing. A constrained request
        whose grammar ended with its token stops there (its output is complete)."""
        _record_logprobs(reqs, logits, tokens)
        finished = []
        ended = set(grammar_ended)
        for row, (req, token) in enumerate(zip(reqs, tokens.tolist())):
            if req.finish_reason is None and self._take(req, token, row in ended):
                finished.append(req)
        return finished

    def _take(self, req: Request, token: int, grammar_ended: bool) -> bool:
        """Appends one token to a live request; True when it ends the request (a stop condition,
        its grammar's end, the context length), whose finish reason is then set."""
        req.output_ids.append(token)
        reason, req.text_trim = self.stop_checker.check(req.output_ids, req.params)
        if reason is None and grammar_ended:
            reason = "stop"
        if reason is None and req.known_len >= self.context_len:
            reason = "length"
        req.finish_reason = reason
        return reason is not None


def _record_logprobs(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Appends each asking live request's token logprob (and its top-k) in one pass over the batch."""
    asking = [i for i, r in enumerate(reqs) if r.logprobs is not None and r.finish_reason is None]
    if asking:
        record_logprobs([reqs[i] for i in asking], logits[asking], tokens[asking])


def record_logprobs(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Appends, per row, the token's logprob (and the top-k) to its request (which asks for them;
    a request may own several rows, in its tokens' order)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(r.params.logprobs for r in reqs)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    for j, req in enumerate(reqs):
        n = req.params.logprobs
        req.logprobs.append(TokenLogprob(chosen[j], top_ids[j, :n].tolist(), top_lp[j, :n].tolist()))


def _record_prompt_logprobs(scored: list[Scored], logits: torch.Tensor) -> None:
    """Appends the scored prompt tokens' logprobs (and top-k) of every request, in one pass."""
    rows = torch.cat([torch.arange(s.first, s.first + s.count) for s in scored]).to(logits.device)
    targets = [t for s in scored for t in s.req.prompt_ids[s.req.next_scored : s.req.next_scored + s.count]]
    logp = torch.log_softmax(logits[rows].float(), dim=-1)  # [n, V]
    chosen = logp.gather(1, torch.tensor(targets, device=logp.device)[:, None])[:, 0].tolist()
    k = max(s.req.params.prompt_logprobs for s in scored)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    i = 0
    for s in scored:
        n = s.req.params.prompt_logprobs
        s.req.prompt_logprobs += [TokenLogprob(chosen[j], top_ids[j][:n], top_lp[j][:n]) for j in range(i, i + s.count)]
        i += s.count
