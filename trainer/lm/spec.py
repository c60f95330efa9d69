"""The language-model workload, as the shared services see it: its roles, settings, launch plan,
status schemas and benchmarks (registered in pyproject.toml under ``rpcps.workloads``).

Light on purpose: what it names as ``"module:attribute"`` is imported only when used."""
from ps.config import PsConfig
from ps.status import PsStatus
from services.workload import BenchSpec, RoleSpec, WorkloadSpec
from trainer.lm.config import LmUpSettings, TrainerConfig
from trainer.lm.status import TrainerStatus

SPEC = WorkloadSpec(
    name="lm",
    help="parameter servers and language-model trainers",
    leader="ps0",
    roles=(RoleSpec("ps", PsConfig, PsStatus, "ps.role:PsRole", "run one parameter server"),
           RoleSpec("trainer", TrainerConfig, TrainerStatus, "trainer.lm.role:TrainerRole", "run one trainer",
                    episodes=True)),
    up=LmUpSettings,
    launch="trainer.lm.launch:LmLaunch",
    checkpoint_dir="checkpoints",
    benches=(BenchSpec("lm", "tokens/s: one process vs the seed design vs rpcps", "trainer.lm.bench"),
             BenchSpec("checkpoint", "checkpoint save/restore of a 2M x 64 shard vs dd", "ps.bench")),
)
