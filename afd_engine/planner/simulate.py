"""Discrete-event simulation of a deployment serving a request trace (`afd plan simulate`).

A deployment is one or more *instances*. An instance is a set of attention ranks (data-parallel
attention, one KV pool each) that step in lockstep, because every MoE layer exchanges tokens between
all of them and the expert GPUs: a colocated DP+EP instance (N GPUs, each an attention rank holding
1/N of the experts) or an AFD instance (A attention GPUs + F expert GPUs, m micro-batches). Under PD
disaggregation, prefill instances compute prompts and send their KV to decode instances.

Each rank schedules as the engine does (runtime/scheduler.py): decodes first, then chunked prefill
continuations, then admissions in fcfs or lpm order, under a token budget per step, a cap on running
requests and a KV pool of pages; when a decode needs a page and none is free or evictable, the newest
running request is preempted and later redone from whatever of it the prefix cache still holds. The
prefix cache is keyed by the trace's block ids; a router sends each request to the rank that holds
the longest cached prefix, unless that rank is much busier than the least loaded one (control/load_balance.py).

An instance's step takes the time a `StepTimeModel` gives for the loads of its ranks: the planner's
roofline (`StageStepTime`, with stage times from `StageModel` or from a `Calibration`, through the
same pipeline formula as `deploy.estimate`), or any other object with a `step` method (the tests use
`LinearStepTime`). Per step the work is proportional to the ranks that have requests, not to the
requests: each rank keeps its decoders' context-length sum, and which of them need a new KV page in
which step, incrementally.

With speculative decoding (`SpecDecoding`) the ranks of the instances that decode verify drafts:
each decode step of a request runs k + 1 rows and keeps a seeded draw of 1..k + 1 tokens, and the
MTP module's draft passes add to the step (`sim/speculative.py`, `sim/drafting_rank.py`).

The code lives in the `afd_engine.planner.sim` package; this module gathers its public names.
"""

from __future__ import annotations

from afd_engine.planner.plot import plot_attainment
from afd_engine.planner.sim.cluster import POLICIES, ROUTERS, ClusterConfig, InstanceConfig, KVLink
from afd_engine.planner.sim.command import DEFAULT_SWEEP, parse_rates, print_report, run_cli
from afd_engine.planner.sim.front_end import FrontEnd
from afd_engine.planner.sim.rank import LPM_MAX_QUEUE, LPM_MAX_WAIT_ROUNDS
from afd_engine.planner.sim.results import SLO, SimResult, simulate
from afd_engine.planner.sim.spec import SPEC_HELP, BuildOptions, DeploymentSpec, build_cluster, parse_spec
from afd_engine.planner.sim.speculative import SpecDecoding
from afd_engine.planner.sim.step_time import LinearStepTime, Load, StageStepTime, StepTimeModel

__all__ = [
    "DEFAULT_SWEEP",
    "LPM_MAX_QUEUE",
    "LPM_MAX_WAIT_ROUNDS",
    "POLICIES",
    "ROUTERS",
    "SLO",
    "SPEC_HELP",
    "BuildOptions",
    "ClusterConfig",
    "DeploymentSpec",
    "FrontEnd",
    "InstanceConfig",
    "KVLink",
    "LinearStepTime",
    "Load",
    "SimResult",
    "SpecDecoding",
    "StageStepTime",
    "StepTimeModel",
    "build_cluster",
    "parse_rates",
    "parse_spec",
    "plot_attainment",
    "print_report",
    "run_cli",
    "simulate",
]
