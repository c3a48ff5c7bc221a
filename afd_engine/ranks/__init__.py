"""What a rank of a deployment runs each step.

- spec.py: the deployment's topology and each rank's expert slots, as every rank computes them.
- attention_runner.py: `PipelineRunner`, an attention rank's lockstep step (agreement rounds,
  micro-batches through the layers, dispatch and combine).
- ffn_worker.py: `FfnWorker`, an FFN rank's loop (descriptors, experts, combine).
- remote_experts.py: the expert executor and server over the dispatch/combine library.
- fault_tolerance*.py: lost FFN ranks, heartbeats, recovery and replacements, for both sides.
- timeline.py: per-rank timing events (`--record-timeline`).
How the rank processes start and stop is in `processes/`.
"""
