"""The RL workload, as the shared services see it: the agent and its observers, their settings,
launch plan, status schemas and benchmark (registered in pyproject.toml under ``rpcps.workloads``).

Light on purpose: what it names as ``"module:attribute"`` is imported only when used."""
from services.workload import BenchSpec, RoleSpec, WorkloadSpec

SPEC = WorkloadSpec(
    name="rl",
    help="the RL agent and its observers on CartPole",
    rank=10,
    leader="agent",
    roles=(RoleSpec("agent", "trainer.rl.config:AgentConfig", "trainer.rl.status:AgentStatus",
                    "trainer.rl.agent:AgentRole", "run the RL agent", indexed=False, episodes=True,
                    metric_families="trainer.rl.metrics:RlMetrics"),
           RoleSpec("observer", "trainer.rl.config:ObserverConfig", "trainer.rl.status:ObserverStatus",
                    "trainer.rl.observer:ObserverRole", "run one RL observer",
                    metric_families="trainer.rl.metrics:RlMetrics")),
    up_settings="trainer.rl.config:RlUpSettings",
    launch="trainer.rl.launch:RlLaunch",
    checkpoint_dir="checkpoints/rl",
    benches=(BenchSpec("rl", "environment steps/s: 1, 2, 4 observers, batched and not", "trainer.rl.bench"),),
    examples=(("--workload rl --observers 4", "the RL agent and four observers, until CartPole is solved"),
              ("--workload rl --episodes 50", "at most 50 episodes, then a final checkpoint and exit 0")),
)
