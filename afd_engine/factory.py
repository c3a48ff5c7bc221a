"""`make_engine(...)`: the engine for any mode, behind the same offline API.

make_engine(model_path=p)                           Engine: the whole model in this process
make_engine(model_path=p, mode="afd", dp_size=2)    DistributedEngine: the ranks as processes
"""

from __future__ import annotations

from afd_engine.engine import Engine
from afd_engine.engine_args import EngineArgs
from afd_engine.offline import OfflineEngine
from afd_engine.offline_deployment import DistributedEngine


def make_engine(args: EngineArgs | None = None, **kwargs) -> OfflineEngine:
    """Keywords are EngineArgs fields and override `args`; `--mode single` runs in this process
    (with --dp-size N, N replicas as processes), the other modes start their ranks as processes
    on this machine."""
    args = args.replace(**kwargs) if args is not None else EngineArgs.from_kwargs(**kwargs)
    args.validate()
    return Engine(args) if args.mode == "single" and args.dp_size == 1 else DistributedEngine(args)
