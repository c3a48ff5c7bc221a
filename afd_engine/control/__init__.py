"""The control plane: how front ends (the HTTP server, `make_engine` deployments) and the engine
processes (the single engine, attention ranks) talk.

    front end (its LoadBalancer picks r)          engine process (one per attention rank r)
    PUSH requests-r  --AddRequest (to rank r)------>  PULL   EngineLoop: add / abort / step
    PUB broadcast    --AbortRequest, Shutdown------>  SUB    (every rank)
    PULL outputs     <--StepOutput, Rejected--------  PUSH   (every rank)

- messages.py: the typed messages and their encode/decode.
- loop.py: the addresses, the front end's socket set-up, and the engine process's loop.
- client.py: the front end's client (routing, submission, hang detection), which the HTTP
  server and the offline API of deployments both drive.
- load_balance.py: which rank takes a request (round robin, shortest queue, cache aware).
It imports the engine; neither `server/` nor `processes/` is imported back.
"""
