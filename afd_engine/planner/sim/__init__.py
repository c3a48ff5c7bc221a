"""The cluster simulator behind `afd plan simulate`, one concern per module:

- `step_time`: how long an instance's step takes for its ranks' loads;
- `cluster`, `front_end`: the instances and KV link being simulated, and how requests reach them;
- `request`, `router`, `kv_cache`, `rank`: a request's state, the router, a rank's KV pool and
  prefix cache, a rank's scheduler;
- `speculative`, `drafting_rank`: speculative decoding's accepted-length draws and draft passes,
  and the rank whose decodes verify drafts;
- `loop`: instances stepping in lockstep and the events between them;
- `results`: `simulate` and what it measures against an SLO;
- `spec`, `command`: deployment SPEC strings and the command line.

`afd_engine.planner.simulate` gathers the public names.
"""
