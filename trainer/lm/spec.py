"""The language-model workload, as the shared services see it: its roles, settings, launch plan,
status schemas and benchmarks (registered in pyproject.toml under ``rpcps.workloads``).

Light on purpose: what it names as ``"module:attribute"`` is imported only when used."""
from services.workload import BenchSpec, HostedSpec, RoleSpec, ScaleCase, TorchrunSpec, WorkloadSpec

SPEC = WorkloadSpec(
    name="lm",
    help="parameter servers and language-model trainers",
    leader="ps0",
    rank=0,
    roles=(RoleSpec("trainer", "trainer.lm.config:TrainerConfig", "trainer.lm.status:TrainerStatus",
                    "trainer.lm.role:TrainerRole", "run one language-model trainer", episodes=True,
                    metric_families="trainer.lm.metrics:TrainerMetrics",
                    # A torchrun worker is a batch job: it trains at once and ends with its episode.
                    torchrun=TorchrunSpec("num_trainers", (("start", "true"), ("exit_when_done", "true")))),),
    server=HostedSpec("trainer.lm.config:LmServerConfig", "trainer.lm.server:lm_model", client_role="trainer"),
    up_settings="trainer.lm.config:LmUpSettings",
    launch="trainer.lm.launch:LmLaunch",
    checkpoint_dir="checkpoints",
    benches=(BenchSpec("lm", "tokens/s: one process vs the seed design vs rpcps (--dense ps and allreduce)",
                       "trainer.lm.bench"),
             BenchSpec("consistency", "tokens/s and held-out loss: async vs sync vs ssp:2, and with a straggler",
                       "trainer.lm.bench_consistency"),
             BenchSpec("checkpoint", "checkpoint save/restore of a 2M x 64 shard vs dd", "ps.bench"),
             BenchSpec("joins", "server memory, fds and threads per trainer join and leave (kills included)",
                       "trainer.lm.bench_joins"),
             BenchSpec("recovery", "--dense allreduce: seconds from a trainer's (or ps1's) SIGKILL to the next step, "
                                   "rpcps's regroup vs torchrun's restart", "trainer.lm.bench_recovery")),
    # The LSTM replicated on the trainers (on the servers, every step would move its 2.6 MB of
    # weights both ways), and 80 sequences a trainer step: the all-reduce of those 2.6 MB a step
    # is paid for 2,800 tokens, not the classic 700.
    scale=(ScaleCase("lm", "the LSTM language model in sync, the LSTM all-reduced among the trainers",
                     ("--workload", "lm", "--eval-tokens", "4000", "--dense", "allreduce", "--consistency", "sync",
                      "--batch-size", "80"), "tokens", "val_loss", higher_is_better=False, efficiency=0.8),),
    examples=(("--steps 40 --data DIR", "40 steps per trainer on a WikiText-style folder, evaluate, exit 0"),
              ("--num-ps 3 --num-trainers 4 --consistency sync", "synchronous updates: every step averaged"),
              ("--consistency sync --dense allreduce", "the LSTM on the trainers, kept in step by all-reduce"),
              ("--checkpoint-every-steps 100 --keep-checkpoints 5", "periodic checkpoints, newest five kept")),
)
