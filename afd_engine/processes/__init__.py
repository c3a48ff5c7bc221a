"""The processes of a deployment: starting, finding, watching and stopping them.

- deployment.py: `Deployment`, which starts every rank of a mode on this machine (or one role's
  ranks of a multi-machine deployment), waits until all are ready and stops them together.
- entrypoints.py: what each rank process runs (an attention rank's engine, an FFN rank's worker).
- rank_process.py, rank_preload.py: ranks fork from one forkserver that imported torch once.
- rendezvous.py: how ranks on several machines find each other (and free ports).
What a rank does each step is in `ranks/`.
"""
