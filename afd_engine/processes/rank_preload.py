"""What the server process that rank processes fork from imports once (afd_engine/processes/
rank_process.py): the heavy imports every rank makes anyway. Nothing here runs a kernel, starts
a thread or touches a GPU."""

from afd_engine.proctitle import set_title

set_title("afd::forkserver")

import torch  # noqa: E402,F401
from transformers import AutoTokenizer  # noqa: E402,F401
