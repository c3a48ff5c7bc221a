"""A hung attention rank (alive, silent) is reported by the offline API of a deployment, through the
same control-plane client the HTTP server uses (tests/control/test_client.py checks that client
alone): `step()` raises DeploymentDied naming the silent rank instead of waiting for ever."""

from __future__ import annotations

import os
import signal
import time

import pytest

from afd_engine import make_engine
from afd_engine.control import client
from afd_engine.offline_deployment import DeploymentDied
from afd_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_stopped_attention_rank_is_reported_as_hung(tiny_v3, monkeypatch):
    monkeypatch.setattr(client, "DEAD_AFTER_S", 3.0)
    with make_engine(
        model_path=tiny_v3, mode="colocated", dp_size=2, num_threads=1, comm_timeout=60, dispatch_dtype="fp32"
    ) as engine:
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        first = engine.generate(prompt_token_ids=[[5, 6, 7], [8, 9, 10]], sampling_params=params)
        assert [len(o.token_ids) for o in first] == [4, 4]
        victim = engine.deployment.procs[-1]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            engine.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=1000))
            stopped = time.monotonic()
            with pytest.raises(DeploymentDied, match=r"attention rank \d has sent nothing for \d+ s"):
                while engine.has_unfinished():
                    engine.step()
            assert time.monotonic() - stopped < 3.0 + 10  # seen within a few health checks of the limit
            with pytest.raises(DeploymentDied):  # and stays reported
                engine.step()
        finally:
            os.kill(victim.pid, signal.SIGCONT)
