"""The RL workload's settings: the agent's, the observers', and what `rpcps up --workload rl` takes."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Optional

from pydantic import Field, model_validator

from services.config import CommonConfig, ConfigBase, LeaderConfig, RestoringConfig
from trainer.rl.env import ENV_PATTERN


class AgentConfig(CommonConfig, RestoringConfig, LeaderConfig):
    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {"checkpoints": ("checkpoint_every_episodes",),
                                                         "cluster": ("min_observers",)}
    name: str = Field("agent", description="RPC name: agent")
    checkpoint_dir: Path = Field(Path("checkpoints/rl"), description="folder of the agent's checkpoints")
    env: str = Field("CartPole-v1", pattern=ENV_PATTERN, description="the observers' environment: CartPole-v1; CartPole-v1:<steps> (restarted until that many, for benchmarks); fixed:<steps> (tests)")
    batched: bool = Field(True, description="one forward pass per step for all observers (--no-batched: the seed's one per observer)")
    hidden: int = Field(128, ge=1, description="hidden units of the policy")
    dropout: float = Field(0.6, ge=0, lt=1, description="dropout in the policy")
    lr: float = Field(1e-2, gt=0, description="Adam learning rate")
    gamma: float = Field(0.99, gt=0, le=1, description="discount factor")
    seed: int = Field(1, description="seed of the policy, its dropout and action draws, and the environments")
    start: bool = Field(False, description="start episodes at launch instead of waiting for a request")
    episodes: Optional[int] = Field(None, ge=1, description="episodes started at launch (default: until solved)")
    max_steps: Optional[int] = Field(None, ge=1, description="cap on environment steps per observer episode (default: the environment's)")
    min_observers: int = Field(1, ge=1, description="observers needed before the first episode starts (later ones go on with whoever is there)")
    checkpoint_every_episodes: Optional[int] = Field(None, ge=1, description="take a checkpoint every N episodes")

    @model_validator(mode="after")
    def _check(self) -> "AgentConfig":
        self._check_role("agent")
        return self


class ObserverConfig(CommonConfig):
    name: str = Field("observer0", description="RPC name: observer<index>")
    env: str = Field("CartPole-v1", pattern=ENV_PATTERN, description="environment to step: CartPole-v1, CartPole-v1:<steps> or fixed:<steps> (see rpcps agent --help)")
    seed: int = Field(1, description="seed of the environment (with the observer's index)")

    @model_validator(mode="after")
    def _check(self) -> "ObserverConfig":
        self._check_role("observer")
        return self


class RlUpSettings(ConfigBase):
    """`rpcps up --workload rl`: the agent's and observers' settings a local cluster starts with."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("observers",), "checkpoints": ("checkpoint_every_episodes", "checkpoint_every_steps")}

    observers: int = Field(4, ge=1, le=64, description="observers to start")
    episodes: Optional[int] = Field(None, ge=1, description="episodes to run at most (default: until solved)")
    env: str = Field("CartPole-v1", pattern=ENV_PATTERN, description="environment (CartPole-v1; CartPole-v1:<steps> or fixed:<steps>, see rpcps agent --help)")
    batched: bool = Field(True, description="one forward pass per step for all observers (--no-batched: the seed's way)")
    max_steps: Optional[int] = Field(None, ge=1, description="cap on steps per observer episode")
    seed: int = Field(1, description="seed of the policy, its dropout and action draws, and the environments (as rpcps agent)")
    checkpoint_every_episodes: Optional[int] = Field(None, ge=1, description="checkpoint every N episodes")
    checkpoint_every_steps: Optional[int] = Field(None, ge=1, description="the same as --checkpoint-every-episodes (an older name)")
