"""AFD engine: Attention-FFN disaggregated serving for Mixture-of-Experts LLMs."""

from afd_engine.engine import Engine
from afd_engine.engine_args import EngineArgs
from afd_engine.runtime.request import RequestOutput
from afd_engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineArgs", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
