"""Speculative decoding with DeepSeek's MTP module: each step verifies drafts and drafts the next ones.

A step of `SpecStepper` (the engine's stepper when --speculative-algorithm is set) runs:

1. the target model over the step's tokens: prefill chunks as always, and every decoding request
   that holds drafts as a chunk of its newest token and its drafts (`StepPlan.verify`), so the
   model scores all of them at once (logits at each of those positions, and every token's last
   hidden state);
2. verification (runtime/spec_verify.py): per request, the longest run of drafts the target
   agrees with (greedy: equal to its argmax; sampled: rejection sampling, which keeps the
   target's distribution) plus one token of the target's own;
3. the MTP module over the same positions, each fed its next token (the prompt's next token, a
   kept draft, or the token verification emitted) and the target's hidden state there: this
   writes the module's own cache layer for every position the request keeps, and its prediction
   after the last kept position is the first new draft;
4. `--speculative-num-steps` - 1 chained steps of the module, one position further each, fed its
   own previous draft and output (their cache entries are rewritten by step 3 of the next step).

The finish appends the kept tokens one at a time with the usual stop checks, so a stop string,
EOS or `max_tokens` inside an accepted run ends the output there and the rest is dropped. A
request keeps as its cached length only the positions whose inputs were the tokens it kept; the
pages past what its next step needs go back to the pool, and the prefix cache only ever takes
pages of kept tokens (it reads `num_cached`).

The drafts are the module's argmax (a deterministic draft): verification of a sampled request
then treats the draft distribution as one-hot on the draft, which keeps sampling exact. Requests
constrained by a grammar (JSON schema, regex, ...) draft too: the grammar's mask is computed at
every draft position (the matcher advanced past the drafts before it), and after verification the
matcher is rolled back to the kept tokens. Requests with other logit processing (penalties, logit
bias, min_tokens) draft nothing: they step one token at a time, with their controls, beside the
others. Steps do not overlap scheduling.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from afd_engine.models.forward_batch import SeqChunk
from afd_engine.runtime.grammar import apply_bitmask, new_bitmask
from afd_engine.runtime.kv_cache import pages_for
from afd_engine.runtime.model_runner import PreparedStep
from afd_engine.runtime.request import Request
from afd_engine.runtime.sampler import SamplingBatch
from afd_engine.runtime.spec_verify import verify
from afd_engine.runtime.stepper import Stepper, _record_prompt_logprobs, _Step, record_logprobs


@dataclass
class SpecCounters:
    """What speculation did since start: verifications of drafting requests, drafts proposed and
    accepted, and how many verifications accepted each count (index = accepted drafts, 0..steps)."""

    steps: int
    verifies: int = 0
    drafts: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.histogram = self.histogram or [0] * (self.steps + 1)

    def add(self, proposed: list[int], accepted: list[int]) -> None:
        for p, a in zip(proposed, accepted):
            if p:
                self.verifies += 1
                self.drafts += p
                self.accepted += a
                self.histogram[a] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step of a drafting request: the accepted drafts plus the target's own."""
        return 1.0 + self.accepted / self.verifies if self.verifies else 0.0


@dataclass
class _Result:
    logits: torch.Tensor  # [rows, V] the step's logit rows
    target: torch.Tensor  # [B, K + 1, V] per sampler, its rows from its first (padded by repeats)
    proposed: list[int]  # per sampler, the drafts it verified
    tokens: list[list[int]]  # per sampler, the tokens it keeps (kept drafts, then the target's)
    drafts: list[list[int]]  # per sampler, its next drafts
    ended: dict[int, int]  # sampler -> index among its kept tokens of the one that ended its grammar


class SpecStepper(Stepper):
    """The stepper of speculative decoding (module doc)."""

    def __init__(self, *args, num_steps: int, **kwargs) -> None:
        super().__init__(*args, overlap=False, **kwargs)
        self.num_steps = num_steps
        self.scheduler.spec_steps = num_steps
        self.counters = SpecCounters(num_steps)

    def step(self) -> tuple[list[Request], list[Request]]:
        step, planned_done = self._plan()
        if step is None:
            return [], planned_done
        sampled, done = self._finish(step, self._execute(step))
        return sampled, done + planned_done

    @torch.inference_mode()
    def _execute(self, step: _Step) -> _Result | None:
        runner, prepared = self.runner, step.prepared
        if not runner.begin_step(prepared.plan):
            return None
        logits, hidden = runner.execute_spec(prepared)
        self.load_recorder.end_step()
        inputs = prepared.inputs
        if not inputs.samplers:
            self._draft(prepared, hidden, None, None)  # the module's cache of the chunks' positions
            return _Result(logits, logits[:0, None], [], [], [], {})
        device = logits.device
        proposed = [n - 1 for n in inputs.sample_counts] if inputs.sample_counts else [0] * len(inputs.samplers)
        counts = torch.tensor(proposed, device=device) + 1
        width = max(proposed) + 1
        first = torch.tensor(inputs.sample_rows, device=device)
        offsets = torch.arange(width, device=device)
        target = logits[first[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)]  # [B, K + 1, V]
        scored, constrained = target, {}
        if step.controls is not None:  # (of the drafting requests, only grammars have controls)
            scored = target.clone()
            scored[:, 0] = step.controls.apply(target[:, 0])
            constrained = _draft_masks(scored, inputs.samplers, proposed)
        drafts = torch.tensor(
            [(r.draft_ids[:p] + [0] * width)[: width - 1] for r, p in zip(inputs.samplers, proposed)],
            dtype=torch.int64,
            device=device,
        ).view(len(inputs.samplers), width - 1)
        batch = step.sampling if step.sampling is not None else SamplingBatch.greedy(device)
        verified = verify(scored, drafts, counts - 1, batch)
        accepted = verified.accepted.tolist()
        tokens = [row[: a + 1] for row, a in zip(verified.tokens.tolist(), accepted)]
        ended = {}
        if step.controls is not None:
            ended = dict.fromkeys(step.controls.accept(verified.tokens[:, 0], frozenset(constrained)), 0)
            for b, advanced in constrained.items():  # back to the kept tokens, then on past the last
                ended.update(_settle(inputs.samplers[b].matcher, advanced, accepted[b], tokens[b], b))
        emitted = verified.tokens.gather(1, verified.accepted[:, None])[:, 0]
        next_drafts = self._draft(prepared, hidden, verified.accepted, emitted)
        return _Result(logits, target, proposed, tokens, next_drafts, ended)

    def _draft(
        self, prepared: PreparedStep, hidden: torch.Tensor, accepted: torch.Tensor | None, emitted: torch.Tensor | None
    ) -> list[list[int]]:
        """Steps 3 and 4 of the module doc; returns each sampler's drafts (fewer where its pages
        end, none for requests whose logits are processed). A lockstep runner (a rank of a
        deployment) runs every pass, with or without tokens, as its peers do."""
        inputs, pool, runner = prepared.inputs, self.scheduler.pool, self.runner
        device = pool.device
        # each position's next token: the request's own next one in the step, and after its last
        # one the prompt's next token where the step does not end the prompt (a sampler's is filled
        # in below)
        next_ids = torch.cat([b["fb"].input_ids for b in prepared.batches]).roll(-1)
        spans = _spans(prepared.plan)
        if spans:
            ends = torch.tensor([n for _, n in spans]).cumsum(0) - 1
            next_ids[ends.to(device)] = torch.tensor([_following(r) for r, _ in spans], device=device)
        samplers = inputs.samplers if accepted is not None else []
        at = torch.zeros(0, dtype=torch.int64, device=device)
        if samplers:
            rows = torch.cat([b["rows"] + off for b, off in zip(prepared.batches, _token_offsets(prepared))])
            at = rows[torch.tensor(inputs.sample_rows, device=device)] + accepted  # [B] flat: last kept
            next_ids[at] = emitted
        logits, out = runner.draft_extend(prepared, next_ids, hidden, at)
        proposal = [logits.argmax(-1)]
        positions = torch.cat([b["fb"].positions for b in prepared.batches])
        pos = (positions[at] + 1).tolist()  # where each sampler's next token goes
        drafting = [i for i, r in enumerate(samplers) if drafts_ok(r.params) and r.params.max_new_tokens > 0]
        for k in range(1, self.num_steps):
            # rows whose pages hold the module's cache entry at position pos + k - 1
            drafting = [i for i in drafting if pool.tokens_capacity(samplers[i].row) >= pos[i] + k]
            if not drafting and not runner.lockstep:
                break
            idx = torch.tensor(drafting, dtype=torch.int64, device=device)
            fed = proposal[-1][idx]
            chain = [SeqChunk(samplers[i].row, pos[i] + k - 1, [t]) for i, t in zip(drafting, fed.tolist())]
            step_logits, step_out = runner.draft_chain(chain, fed, out[idx])
            nxt = torch.full_like(proposal[-1], -1)  # -1: a row that stopped drafting
            nxt[idx] = step_logits.argmax(-1)
            out[idx] = step_out
            proposal.append(nxt)
        table = torch.stack(proposal, dim=1).tolist()  # [B, steps]
        drafts = []
        for i, r in enumerate(samplers):
            row = table[i] if drafts_ok(r.params) else []
            drafts.append(row[: row.index(-1)] if -1 in row else row)
        return drafts

    def _finish(self, step: _Step, result: _Result | None) -> tuple[list[Request], list[Request]]:
        plan, inputs = step.prepared.plan, step.prepared.inputs
        for req in inputs.samplers:
            req.inflight.pop(0)
        if result is None:
            return [], []
        done = []
        if inputs.scored:
            _record_prompt_logprobs(inputs.scored, result.logits)
        if inputs.samplers:
            done += self._append(inputs.samplers, result)
        return self._close(plan, inputs, done)

    def _append(self, reqs: list[Request], result: _Result) -> list[Request]:
        """Appends each live request's kept tokens up to the first that ends it; records their
        logprobs; counts its kept drafts as cached; keeps its next drafts."""
        finished, ended, taken = [], result.ended, []
        for row, (req, tokens) in enumerate(zip(reqs, result.tokens)):
            mine = []
            if req.finish_reason is None:  # (one that ended or was aborted meanwhile takes nothing)
                for j, token in enumerate(tokens):
                    mine.append(token)
                    if self._take(req, token, ended.get(row) == j):
                        finished.append(req)
                        break
            taken.append(mine)
            req.num_new = len(mine)
        self._record(reqs, result, taken)
        self.counters.add(result.proposed, [len(t) - 1 for t in result.tokens])
        for req, mine, drafts in zip(reqs, taken, result.drafts):
            if req.finish_reason is not None:
                req.draft_ids = []
                continue
            req.num_cached += len(mine) - 1  # a verify's kept drafts: their positions are cached now
            remaining = req.params.max_new_tokens - len(req.output_ids)
            room = self.context_len - req.total_len
            req.draft_ids = drafts[: max(0, min(remaining - 1, room - 1))]
            self._release(req)
        return finished

    def _record(self, reqs: list[Request], result: _Result, taken: list[list[int]]) -> None:
        """The logprobs of every appended token, each from its own position's logits."""
        asking = [(i, j) for i, r in enumerate(reqs) if r.logprobs is not None for j in range(len(taken[i]))]
        if not asking:
            return
        index = torch.tensor(asking, device=result.target.device)
        logits = result.target[index[:, 0], index[:, 1]]
        tokens = torch.tensor([taken[i][j] for i, j in asking], device=logits.device)
        record_logprobs([reqs[i] for i, _ in asking], logits, tokens)

    def _release(self, req: Request) -> None:
        """Frees the pages past what the request's next step and its chained draft steps need."""
        pool = self.scheduler.pool
        need = self.scheduler.spec_need(req.num_cached + 1 + len(req.draft_ids))
        pool.shrink(req.row, pages_for(need, pool.page_size))


def _token_offsets(prepared: PreparedStep) -> list[int]:
    """Each micro-batch's first token in the step's flat token order."""
    return list(itertools.accumulate((b["fb"].num_tokens for b in prepared.batches[:-1]), initial=0))


def drafts_ok(params) -> bool:
    """Whether a request drafts: unless its logits are processed by more than a grammar (penalties,
    logit bias and min_tokens would need the drafts' effect at every position)."""
    return not (params.penalized or params.logit_bias or params.min_tokens)


def _draft_masks(scored: torch.Tensor, samplers: list[Request], proposed: list[int]) -> dict[int, int]:
    """The grammar masks at the draft positions of constrained drafting requests, applied in place
    to `scored` [B, K + 1, V]; returns, per such sampler, the drafts its matcher advanced past."""
    rows = [b for b, (r, p) in enumerate(zip(samplers, proposed)) if p and r.matcher is not None]
    if not rows:
        return {}
    width, vocab = scored.shape[1], scored.shape[2]
    bitmask = new_bitmask(len(rows) * width, vocab)
    flat, advanced = [], {}
    for i, b in enumerate(rows):
        positions = [i * width + j for j in range(1, proposed[b] + 1)]
        advanced[b] = samplers[b].matcher.advance_drafts(samplers[b].draft_ids[: proposed[b]], bitmask, positions)
        flat += positions[: advanced[b]]
    if flat:
        view = scored[rows].view(len(rows) * width, vocab)
        apply_bitmask(view, bitmask, flat)
        scored[rows] = view.view(len(rows), width, vocab)
    return advanced


def _settle(matcher, advanced: int, accepted: int, kept: list[int], row: int) -> dict[int, int]:
    """A constrained request's matcher after verification: rolled back to its kept drafts, then
    past the rest of its kept tokens; {row: index of the kept token that ended the grammar} where
    one did."""
    matcher.rollback(max(0, advanced - accepted))
    for j, token in enumerate(kept[min(advanced, accepted) :], start=min(advanced, accepted)):
        if matcher.accept(token):
            return {row: j}
    return {}


def _spans(plan) -> list[tuple[Request, int]]:
    """Each request of a step with its tokens' count, in the step's flat token order (prefill
    chunks, plain decodes, verifying decodes: model_runner.StepInputs)."""
    return list(plan.extend) + [(r, 1) for r in plan.decode] + list(plan.verify)


def _following(req: Request) -> int:
    """The token after a request's last one in the step where it is known now (the prompt's, or
    an output token a resumed request computes again), else 0 (a sampler's: the step fills it in).
    `req.num_cached` counts the step already."""
    end = req.num_cached
    return req.tokens(end, end + 1)[0] if end < req.known_len else 0
