"""The control plane: how front ends (the HTTP server, `make_engine` deployments) and the engine
processes (the single engine, attention ranks) talk.

    front end                                 engine process (one per attention rank)
    PUSH requests  --AddRequest (round robin)-->  PULL   EngineLoop: add / abort / step
    PUB broadcast  --AbortRequest, Shutdown---->  SUB
    PULL outputs   <--StepOutput, Rejected------  PUSH

- messages.py: the typed messages and their encode/decode.
- loop.py: the addresses, the front end's socket set-up, and the engine process's loop.
It imports the engine; neither `server/` nor `distributed/` is imported back.
"""
