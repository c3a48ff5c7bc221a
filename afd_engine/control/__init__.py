"""The control plane: how front ends (the HTTP server, `make_engine` deployments) and the engine
processes (the single engine, attention ranks) talk.

    front end (its Router picks r)                 engine process (one per attention rank r)
    PUSH requests-r  --AddRequest (to rank r)------>  PULL   EngineLoop: add / abort / step
    PUB broadcast    --AbortRequest, Shutdown------>  SUB    (every rank)
    PULL outputs     <--StepOutput, Rejected--------  PUSH   (every rank)

- messages.py: the typed messages and their encode/decode.
- loop.py: the addresses, the front end's socket set-up, and the engine process's loop.
- router.py: which rank takes a request (round robin, shortest queue, cache aware).
It imports the engine; neither `server/` nor `distributed/` is imported back.
"""
