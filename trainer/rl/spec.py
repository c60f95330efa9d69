"""The RL workload, as the shared services see it: the agent and its observers, their settings,
launch plan, status schemas and benchmark (registered in pyproject.toml under ``rpcps.workloads``).

Light on purpose: what it names as ``"module:attribute"`` is imported only when used."""
from services.workload import BenchSpec, RoleSpec, WorkloadSpec
from trainer.rl.config import AgentConfig, ObserverConfig, RlUpSettings
from trainer.rl.metrics import RlMetrics
from trainer.rl.status import AgentStatus, ObserverStatus

SPEC = WorkloadSpec(
    name="rl",
    help="the RL agent and its observers on CartPole",
    leader="agent",
    roles=(RoleSpec("agent", AgentConfig, AgentStatus, "trainer.rl.agent:AgentRole", "run the RL agent",
                    indexed=False, episodes=True, metrics=RlMetrics),
           RoleSpec("observer", ObserverConfig, ObserverStatus, "trainer.rl.observer:ObserverRole",
                    "run one RL observer", metrics=RlMetrics)),
    up=RlUpSettings,
    launch="trainer.rl.launch:RlLaunch",
    checkpoint_dir="checkpoints/rl",
    benches=(BenchSpec("rl", "environment steps/s: 1, 2, 4 observers, batched and not", "trainer.rl.bench"),),
)
