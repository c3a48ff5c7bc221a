"""Admin routes: GET /expert_load (the expert load statistics and placement of the deployment)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, Field

from afd_engine.server.errors import error_responses
from afd_engine.server.state import ServerState


class ExpertPlacement(BaseModel):
    version: int = Field(description="0 at start, higher with every rebalance, recovery or admission")
    slots_per_rank: int
    slot_expert: dict[str, list[int]] = Field(description="per MoE layer: the logical expert of each physical slot")
    dead: list[int] = Field(
        default_factory=list, description="FFN ranks lost and served without (--enable-ffn-fault-tolerance)"
    )


class ExpertLoad(BaseModel):
    moe_layers: list[int]
    num_experts: int
    window_steps: int = Field(description="steps the load window covers (at most)")
    steps: int = Field(description="steps run since start")
    attention_ranks: int
    load: list[list[int]] = Field(description="[MoE layer][expert]: tokens routed in the window, all ranks summed")
    placement: ExpertPlacement
    expert_rank_load: list[float] = Field(description="tokens per expert rank in the window, under the placement")
    imbalance: float = Field(description="max over mean of expert_rank_load (1.0: balanced)")


def admin_routes(app: FastAPI, state: Callable[[], ServerState]) -> None:
    @app.get("/expert_load", response_model=ExpertLoad, responses=error_responses(401, 503))
    async def expert_load():
        return await state().client.expert_load()
