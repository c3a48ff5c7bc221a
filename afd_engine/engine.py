"""The offline engine: `Engine(...).generate(...)`, and the step loop every front end drives."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from afd_engine.checkpoint_tokenizer import load_tokenizer
from afd_engine.default_model import resolve_model_path
from afd_engine.disagg.sides import make_side
from afd_engine.engine_args import EngineArgs
from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.eplb.recorder import ExpertLoadRecorder
from afd_engine.eplb.report import merge_reports, rank_report
from afd_engine.errors import ConfigError, InvalidRequestError
from afd_engine.model_config import ModelConfig
from afd_engine.models import Kernels, load_model
from afd_engine.models.checkpoint import inspect_checkpoint
from afd_engine.offline import OfflineEngine
from afd_engine.runtime.cuda_graph import GraphRunner, graph_safe_moe, needs_slot_tables
from afd_engine.runtime.grammar import GrammarCompiler
from afd_engine.runtime.host_memory import retain_freed_memory
from afd_engine.runtime.kv_cache import KVPool, pages_for
from afd_engine.runtime.model_runner import ModelRunner, StepRunner
from afd_engine.runtime.radix_cache import RadixCache
from afd_engine.runtime.request import Request, RequestOutput, TokenUpdate
from afd_engine.runtime.scheduler import Scheduler
from afd_engine.runtime.spec_step import SpecStepper
from afd_engine.runtime.step_recorder import StepRecorder
from afd_engine.runtime.stepper import Stepper
from afd_engine.runtime.stop_checker import StopChecker, trim_text
from afd_engine.sampling_params import SamplingParams

RankRunnerFactory = Callable[[torch.nn.Module, KVPool], StepRunner]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankContext:
    """What a rank of a deployment adds to an Engine.

    `index` is the attention rank's number; `make_runner(model, pool)` makes its step runner
    (lockstep with its peers); `expert_slots` is which routed experts the rank holds (per MoE
    layer, the expert of each slot; {} for none); `device` is the rank's device (`--device` names
    the deployment's)."""

    index: int
    make_runner: RankRunnerFactory
    expert_slots: dict[int, list[int]]
    device: torch.device


class Engine(OfflineEngine):
    """Loads a checkpoint and serves requests in this process: scheduler, KV pool, model, sampler.

    Keywords are EngineArgs fields (the CLI flags with underscores):
    ``Engine(model_path=path, dtype="float32", kv_cache_memory_mb=64)``. It runs the whole model
    (--mode single); `make_engine(...)` starts a deployment of several ranks for the other modes.
    A rank of such a deployment builds its Engine with that rank's runner and experts.
    """

    def __init__(self, args: EngineArgs | None = None, *, rank: RankContext | None = None, **kwargs) -> None:
        """`rank`: what a rank of a deployment adds (its runner, experts and device); without it this
        process runs the whole model on `args.device_for(0)`."""
        args = _resolved(args, kwargs, rank)
        self.args, self.rank = args, rank
        self.device = _claim_device(args, rank)
        self.model_path = resolve_model_path(args.model_path)
        # a deployment's rank runs on a checkpoint its launcher has inspected already
        self.config = (
            ModelConfig.from_pretrained(self.model_path)
            if rank
            else inspect_checkpoint(self.model_path, mtp=args.spec_steps > 0)
        ).with_index_cache(args.index_cache_dtype, args.torch_dtype.itemsize)
        self.tokenizer = load_tokenizer(self.model_path)
        kernels = Kernels.named(args.attention_backend, args.moe_backend, self.config.attention)
        experts = rank.expert_slots if rank else None
        self.model = load_model(
            self.config,
            self.model_path,
            args.torch_dtype,
            experts,
            kernels,
            self.device,
            args.ffn_weight_dtype,
            mtp=args.spec_steps > 0,
        )
        self.load_recorder = ExpertLoadRecorder(
            self.config.moe_layers, self.config.n_routed_experts, args.load_window_steps
        )
        self.model.load_recorder = self.load_recorder
        self._local_map: ExpertMap | None = None
        max_pos = self.config.max_position_embeddings
        self.context_len = min(args.context_length or max_pos, max_pos)
        self.pool = _make_pool(self.config, args, self.context_len, self.device)
        self.cache = RadixCache(self.pool, enabled=not args.disable_radix_cache)
        self.scheduler = Scheduler(
            self.pool, args.max_num_batched_tokens, args.max_running_requests, self.context_len, self.cache,
            args.schedule_policy,
        )  # fmt: skip
        self.runner: StepRunner = (rank.make_runner if rank else ModelRunner)(self.model, self.pool)
        self.graph_capture_seconds = None if rank else self._capture_graphs()
        self.recorder = None
        if args.record_steps:
            self.recorder = StepRecorder(_record_path(args.record_steps, rank), self.runner.execute)
            self.runner.execute = self.recorder
        eos = set(self.config.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        self.stepper = self._make_stepper(eos)
        self.disagg = make_side(self)  # prefill-decode disaggregation: None unless --disaggregation-mode
        # constrained requests wait here for their grammar, compiled on a worker thread
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, sorted(eos))
        self._compiling: list[tuple[Request, Future, Callable[[Request], None]]] = []
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(args.seed)

    def _make_stepper(self, eos: set[int]) -> Stepper:
        args = self.args
        parts = (
            self.scheduler,
            self.runner,
            StopChecker(self.tokenizer, eos),
            self.load_recorder,
            self.context_len,
            self.config.vocab_size,
        )
        if args.spec_steps:  # (speculative steps never overlap)
            return SpecStepper(*parts, num_steps=args.spec_steps)
        # a prefill instance sends each step's pages right after it: no step may be under way then
        return Stepper(*parts, overlap=args.overlap_on(self.device) and args.disaggregation_mode != "prefill")

    def _capture_graphs(self) -> float | None:
        """Single mode on a GPU: captures the decode CUDA graphs (runtime/cuda_graph.py); returns the
        seconds it took, None when decode steps run eagerly (CPU, --disable-cuda-graph, or a MoE
        backend that reads the host). With --static-decode and no capture, decode steps run the
        graphs' padded static path eagerly."""
        args = self.args
        capture = self.device.type == "cuda" and not args.disable_cuda_graph
        if capture and args.spec_steps:  # speculative steps (verify and draft passes) run eagerly
            log.info("CUDA graphs off: speculative decoding's steps run eagerly")
            capture = False
        if capture and not graph_safe_moe(args.moe_backend):
            log.info("CUDA graphs off: the %s MoE backend reads the host during a step", args.moe_backend)
            capture = False
        if not capture and not args.static_decode:
            return None
        graphs = GraphRunner(
            self.model,
            self.pool,
            args.graph_buckets(),
            needs_slot_tables(args.attention_backend),
            self.load_recorder,
            capture=capture,
        )  # without capture (--static-decode): the same padded static path, run eagerly
        seconds = graphs.capture_all()
        if not capture:
            self.runner.graphs = graphs
            return None
        self.runner.graphs = graphs
        log.info("captured CUDA graphs for decode batches %s in %.1f s", graphs.buckets, seconds)
        return seconds

    # -- the control loop's view ---------------------------------------------------------------

    @property
    def lockstep(self) -> bool:
        """True for a rank of a deployment: it must take part in every step its peers agree on."""
        return self.runner.lockstep

    @property
    def stopped(self) -> bool:
        return self.runner.stopped

    @property
    def peers_busy(self) -> bool:
        """A lockstep rank whose last round ran a step: its peers have work, so the next round
        follows at once (idle or not, this rank takes part)."""
        return self.runner.lockstep and self.runner.ran

    def request_stop(self) -> None:
        """Stops stepping: at once, or for a rank of a deployment in a round all ranks agree on."""
        self.runner.request_stop()

    # -- request lifecycle -------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        disaggregation: dict | None = None,
    ) -> str:
        """Queues one request; raises InvalidRequestError (and queues nothing) if it cannot run.
        `disaggregation` is {"room": R} on a prefill instance and {"room": R, "bootstrap":
        "HOST:PORT"} on a decode instance (what `afd router` adds); elsewhere it must be None.
        With "resume": [token ids] (on both instances), the request resumes one whose decode
        instance was lost after generating those tokens: they lead its output (max_new_tokens,
        seeded draws, penalties, stop strings and grammars count them), and it prefills the
        prompt and them. {"resume": [token ids]} alone, on any engine, resumes a request of a lost
        attention rank of the same deployment alike (control/failover.py)."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        if params.logit_bias and max(t for t, _ in params.logit_bias) >= self.config.vocab_size:
            raise InvalidRequestError(
                f"logit_bias token ids must be below the vocabulary size ({self.config.vocab_size})", param="logit_bias"
            )
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(rid=rid, prompt_ids=ids, params=params, seed=seed)
        if _resume_only(disaggregation):  # the front end resumes a lost attention rank's request here
            resumed = self._resumed_ids(disaggregation["resume"], len(ids), params)
            req.output_ids, req.num_resumed = resumed, len(resumed)
            disaggregation = None
        if disaggregation is None and (self.disagg is None or self.args.disaggregation_mode == "decode"):
            # (a decode instance prefills a request sent without a room itself: `afd router
            # --local-prefill-max-tokens` sends it short prompts so)
            if params.guide is not None:  # (scheduler.add checks a request it takes at once)
                self.scheduler.check(req)
            admit = self.scheduler.add
        else:
            self._check_disaggregation(disaggregation)
            req.disagg_room, req.disagg_bootstrap = disaggregation["room"], disaggregation.get("bootstrap")
            resumed = self._resumed_ids(disaggregation.get("resume"), len(ids), params)
            req.output_ids, req.num_resumed = resumed, len(resumed)
            self.scheduler.check(req)
            admit = self.disagg.add
        if params.guide is None:
            admit(req)
        else:  # scheduled once its grammar is compiled
            self._compiling.append((req, self.grammars.submit(params.guide), admit))
        self._requests[rid] = req
        return rid

    def _admit_compiled(self) -> list[Request]:
        """Schedules the constrained requests whose grammar is ready; returns those whose grammar
        failed to compile (they end with an error)."""
        waiting, failed = [], []
        for req, future, admit in self._compiling:
            if req.finish_reason is not None:  # aborted while it waited
                continue
            if not future.done():
                waiting.append((req, future, admit))
            elif future.exception() is not None:
                req.finish_reason, req.error = "error", f"the request's grammar did not compile: {future.exception()}"
                failed.append(req)
            else:
                req.grammar = future.result()
                admit(req)
        self._compiling = waiting
        return failed

    @property
    def compiling(self) -> bool:
        """Whether requests wait for their grammar (and for nothing else)."""
        return bool(self._compiling)

    def _check_disaggregation(self, d: dict | None) -> None:
        mode = self.args.disaggregation_mode
        if mode == "null":
            raise InvalidRequestError(
                "this instance is not disaggregated (--disaggregation-mode null): send requests without bootstrap_room",
                param="bootstrap_room",
            )
        if not isinstance(d, dict) or not isinstance(d.get("room"), int) or isinstance(d.get("room"), bool):
            raise InvalidRequestError(
                f"this is a {mode} instance (--disaggregation-mode {mode}): its requests come through "
                "`afd router`, which gives each one a bootstrap_room",
                param="bootstrap_room",
            )
        if self.disagg.room_in_use(d["room"]):
            raise InvalidRequestError(
                f"bootstrap_room {d['room']} is in use by another request on this instance", param="bootstrap_room"
            )
        if mode == "decode" and not isinstance(d.get("bootstrap"), str):
            raise InvalidRequestError(
                "a decode instance needs the prefill instance's bootstrap_host and bootstrap_port",
                param="bootstrap_host",
            )

    def _resumed_ids(self, resume, prompt_len: int, params: SamplingParams) -> list[int]:
        """The output tokens a resumed request starts from (`afd router` failover), checked."""
        if resume is None:
            return []
        vocab = self.config.vocab_size
        if not isinstance(resume, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in resume
        ):
            raise InvalidRequestError(f"resume must list token ids in [0, {vocab})", param="resume")
        if len(resume) >= params.max_new_tokens or prompt_len + len(resume) >= self.context_len:
            raise InvalidRequestError(
                f"resume lists {len(resume)} tokens: nothing is left to generate within max_new_tokens "
                f"({params.max_new_tokens}) and the context length ({self.context_len})",
                param="resume",
            )
        return list(resume)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if self.disagg is not None and req.disagg_room is not None:
            self.disagg.drop(req)
        self.scheduler.remove(req)
        req.finish_reason = "abort"
        return self._output(req)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work() or bool(self._compiling) or (self.disagg is not None and self.disagg.has_work())
        )

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling round; returns the requests that finished in the step it finished
        (with overlapped scheduling, the step before the one it started)."""
        return [self._output(req) for req in self._step()[2]]

    def step_updates(self) -> list[TokenUpdate]:
        """Like `step`, but returns, per request touched, its new token and finish state (what a
        streaming front end forwards)."""
        arrived, sampled, finished = self._step()
        done = {id(r) for r in finished}
        updates = [self._update(r, r.output_ids[-r.num_new :], id(r) in done) for r in sampled]
        if arrived:  # decode side: first tokens from the prefill side (and a second if a step ran)
            stepped = {id(r) for r in sampled}
            first = [
                self._update(r, r.output_ids[r.num_resumed : r.num_resumed + 1], id(r) in done and id(r) not in stepped)
                for r in arrived
            ]
            updates = first + updates
        told = {id(r) for r in sampled} | {id(r) for r in arrived}
        return updates + [self._update(r, [], True) for r in finished if id(r) not in told]

    def _update(self, req: Request, new: list[int], finished: bool) -> TokenUpdate:
        prompt_logprobs = None  # sent once, with the first update after the prompt was scored
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and req.next_scored == len(req.prompt_ids):
            prompt_logprobs, req.prompt_logprobs_sent = list(req.prompt_logprobs), True
        timeline = None  # disaggregated (decode side): sent once, with the second token or the finish
        decoded = len(req.output_ids) > req.num_resumed + 1
        if req.timeline is not None and "kv_at" in req.timeline and (decoded or finished):
            timeline = dict(req.timeline)
            kv_at = timeline.pop("kv_at")
            timeline["first_decode_step_s"] = time.monotonic() - kv_at if decoded else 0.0
            req.timeline = None
        return TokenUpdate(
            req.rid,
            new,
            req.logprobs[-len(new) :] if req.logprobs is not None and new else None,
            req.finish_reason if finished else None,
            req.error,
            req.text_trim,
            len(req.prompt_ids),
            len(req.output_ids),
            req.num_cached_tokens,
            prompt_logprobs,
            timeline,
        )

    def _step(self) -> tuple[list[Request], list[Request], list[Request]]:
        """(requests whose first token came from a prefill instance, requests that got a token,
        requests that finished) of one step."""
        if self.recorder is not None:  # the requests the step can take are in: its round begins
            self.recorder.began = time.monotonic()
        arrived, failed = [], self._admit_compiled() if self._compiling else []
        if self.disagg is None:
            sampled, done = self.stepper.step()
        else:
            arrived, ended = self.disagg.before_step()  # (decode side: first tokens from the prefill side)
            if self.recorder is not None:
                self.recorder.joins += len(arrived)
            for req in ended:
                self.scheduler.remove(req)
            sampled, done = self.stepper.step()
            handed_off = self.disagg.after_step()  # (prefill side: transferred, or failed)
            for req in handed_off:
                self.scheduler.remove(req)
            done = ended + done + handed_off
        done = failed + done if failed else done
        for req in done:
            self._requests.pop(req.rid, None)
        if self.recorder is not None:  # (counted in the rank's next step)
            self.recorder.left += len(done)
        return arrived, sampled, done

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        return RequestOutput(
            req.rid,
            req.prompt_ids,
            list(req.output_ids),
            trim_text(text, req.text_trim),
            req.finish_reason,
            req.error,
            req.logprobs,
            req.num_cached_tokens,
            req.prompt_logprobs,
        )

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids", param="prompt")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string", param="prompt")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.config.vocab_size for t in ids):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.config.vocab_size})", param="prompt_token_ids"
            )
        return ids

    # -- expert load ---------------------------------------------------------------------------

    @property
    def expert_map(self) -> ExpertMap:
        """The placement this rank dispatches through (single mode: every expert here, one rank)."""
        if self.runner.expert_map is not None:
            return self.runner.expert_map
        if self._local_map is None:
            self._local_map = ExpertMap.initial(
                ExpertLayout(self.config.n_routed_experts, 0, 1, 1), self.config.moe_layers
            )
        return self._local_map

    def expert_load_report(self) -> dict:
        """This rank's expert load window and placement (eplb/report.py)."""
        return rank_report(self.load_recorder, self.expert_map)

    def ffn_fault_counters(self) -> tuple[int, int, int]:
        """AFD (fault tolerance): FFN ranks serving, recoveries so far, experts they read from the
        checkpoint; zeros where the runner has no FFN ranks."""
        r = self.runner
        return getattr(r, "ffn_alive", 0), getattr(r, "recoveries", 0), getattr(r, "experts_read", 0)

    def experts_loaded(self) -> tuple[int, int]:
        """Experts (per layer) the expert ranks loaded since start for recoveries, admissions and
        rebalances: (copied from a live peer, read from the checkpoint); zeros without expert ranks."""
        return getattr(self.runner, "experts_loaded", (0, 0))

    def static_decode_batches(self) -> int:
        """Decode batches (micro-batches, on an attention rank) run on the persistent buffers CUDA
        graphs replay: graph replays on a GPU, the static path of --static-decode elsewhere."""
        r = self.runner
        graphs, static = getattr(r, "graphs", None), getattr(r, "static", None)
        return (graphs.replays if graphs is not None else 0) + (static.steps if static is not None else 0)

    def spec_counters(self) -> tuple[int, int, int, tuple[int, ...]]:
        """Speculative decoding since start (runtime/spec_step.SpecCounters): verifications, drafts
        proposed, drafts accepted, verifications per accepted count; zeros without it."""
        c = getattr(self.stepper, "counters", None)
        if c is None:
            return 0, 0, 0, ()
        return c.verifies, c.drafts, c.accepted, tuple(c.histogram or ())

    def expert_rank_load(self) -> tuple[float, ...]:
        """Tokens per expert rank over this rank's window, under the current placement."""
        return tuple(self.expert_map.rank_loads(self.load_recorder.window()).tolist())

    def expert_load(self) -> dict:
        """Tokens routed per MoE layer and expert over the window, the placement, and the
        expert ranks' loads and imbalance."""
        return merge_reports([self.expert_load_report()])

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        for rid in list(self._requests):
            self.abort(rid)
        self.stepper.close()
        self.grammars.close()
        self.runner.close()
        if self.recorder is not None:
            self.recorder.file.close()
        if self.disagg is not None:
            self.disagg.close()


def _resolved(args: EngineArgs | None, kwargs: dict, rank: RankContext | None) -> EngineArgs:
    args = args.replace(**kwargs) if args is not None else EngineArgs.from_kwargs(**kwargs)
    args.validate()
    if rank is None and args.mode != "single":
        raise ConfigError(
            f"Engine(...) runs the whole model in this process, but --mode={args.mode}: use "
            "afd_engine.make_engine(...), which starts the deployment's ranks"
        )
    return args


def _claim_device(args: EngineArgs, rank: RankContext | None) -> torch.device:
    """This process's device, made current; also its threads and allocator settings."""
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # a step's large temporaries are reused, not page-faulted in again
    device = rank.device if rank else args.device_for(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _record_path(path: str, rank: RankContext | None) -> str:
    """--record-steps: a rank of a deployment writes PATH.a<rank>.jsonl beside the others."""
    return path if rank is None else f"{path}.a{rank.index}.jsonl"


def _make_pool(cfg: ModelConfig, args: EngineArgs, context_len: int, device: torch.device) -> KVPool:
    layers = cfg.num_layers + (1 if args.spec_steps else 0)  # the MTP module's own cache layer
    page_bytes = KVPool.bytes_per_page(layers, cfg.kv_cache_dim, args.page_size, args.torch_dtype)
    if args.max_total_tokens is not None:
        num_pages = pages_for(args.max_total_tokens, args.page_size)
    else:
        num_pages = int(args.kv_cache_memory_mb * 2**20) // page_bytes
    return KVPool(
        layers,
        cfg.kv_cache_dim,
        num_pages,
        args.page_size,
        args.max_running_requests,
        pages_for(context_len, args.page_size),
        args.torch_dtype,
        device,
    )


def _resume_only(disaggregation) -> bool:
    """{"resume": [...]} and nothing else: a request resumed from a lost attention rank."""
    return isinstance(disaggregation, dict) and set(disaggregation) == {"resume"}
