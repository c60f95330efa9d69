"""The click-through-rate workload, as the shared services see it: a DLRM whose 26 embedding tables
(Criteo Kaggle's, scalable) are sharded over the parameter servers, trained by ``ctr`` trainers
(registered in pyproject.toml under ``rpcps.workloads``).

Light on purpose: what it names as ``"module:attribute"`` is imported only when used."""
from services.workload import BenchSpec, HostedSpec, RoleSpec, TorchrunSpec, WorkloadSpec

SPEC = WorkloadSpec(
    name="ctr",
    help="parameter servers and click-through-rate (DLRM) trainers",
    leader="ps0",
    rank=20,
    roles=(RoleSpec("ctr", "trainer.ctr.config:CtrTrainerConfig", "trainer.ctr.status:CtrStatus",
                    "trainer.ctr.role:CtrTrainer", "run one click-through-rate trainer", episodes=True,
                    metric_families="trainer.ctr.metrics:CtrMetrics",
                    torchrun=TorchrunSpec("num_trainers", (("start", "true"), ("exit_when_done", "true")))),
           RoleSpec("serve", "trainer.ctr.serving.config:ServeSettings", "trainer.ctr.serving.status:ServeStatus",
                    "trainer.ctr.serving.role:ServeRole", "answer POST /predict with a trained model's click "
                    "probabilities, from an exported folder or the live servers",
                    metric_families="trainer.ctr.serving.status:ServeMetrics",
                    routes="trainer.ctr.serving.routes:add_routes")),
    server=HostedSpec("trainer.ctr.config:CtrServerConfig", "trainer.ctr.server:ctr_model", client_role="ctr"),
    up_settings="trainer.ctr.config:CtrUpSettings",
    launch="trainer.ctr.launch:CtrLaunch",
    checkpoint_dir="checkpoints/ctr",
    data=(BenchSpec("ctr", "generated Criteo-shaped samples as Criteo TSV files", "trainer.ctr.datagen"),
          BenchSpec("ratings", "generated movie-rating samples (user, movie, genre list, numeric columns) as CSV",
                    "trainer.ctr.datagen_ratings"),
          BenchSpec("check", "read data files as a feature schema says: each column's cardinality, missing rate "
                             "and list lengths", "trainer.ctr.datacheck")),
    commands=(BenchSpec("export", "a checkpoint's model as a folder a program loads without servers "
                                  "(rpcps.load_model): every table whole, the dense weights, the schema",
                        "trainer.ctr.export"),),
    benches=(BenchSpec("ctr", "samples/s, AUC and memory: one process vs async, sync and sync-allreduce servers",
                       "trainer.ctr.bench"),
             BenchSpec("serve", "rpcps serve, snapshot and online: latency of one row, rows/s batched, "
                                "freshness, and what it costs training beside it", "trainer.ctr.serving.bench"),
             BenchSpec("cache", "a trainer's rows cache alone on generated Criteo batches: hit rate per table by "
                                "ids and by lookups, milliseconds a step", "trainer.ctr.bench_cache"),
             BenchSpec("embeddings", "a hashed table against a plain one in one server: rows/s, bytes a row, "
                                     "eviction", "ps.server.hashed.bench")),
    examples=(("--workload ctr --steps 200 --scale 0.01", "a DLRM on generated data at 1 % of Criteo's rows: "
                                                          "held-out AUC beside the best possible"),
              ("--workload ctr --data day_0.gz --steps 1000", "Criteo-format files, streamed"),
              ("--workload ctr --consistency sync --dense allreduce", "the MLPs on the trainers, all-reduced"),
              ("--workload ctr --tables hashed --table-capacity 20000 --admit-after 2",
               "tables keyed by raw 64-bit ids, within a capacity"),
              ("--workload ctr --model mypkg.models:MyModel --schema features.yaml --data dir/",
               "your model and your columns"),
              ("--workload ctr --serve 1", "and a serving member answering POST /predict from the live servers")),
)
