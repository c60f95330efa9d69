"""The click-through-rate workload, as the shared services see it: a DLRM whose 26 embedding tables
(Criteo Kaggle's, scalable) are sharded over the parameter servers, trained by ``ctr`` trainers
(registered in pyproject.toml under ``rpcps.workloads``).

Light on purpose: what it names as ``"module:attribute"`` is imported only when used."""
from services.workload import BenchSpec, HostedSpec, RoleSpec, ScaleCase, TorchrunSpec, WorkloadSpec

# The built-in DLRM as `rpcps bench scale` trains it: a tenth of Criteo's rows, 2,048 samples a
# trainer step (as `rpcps bench ctr`).
_DLRM = ("--workload", "ctr", "--scale", "0.1", "--batch-size", "2048", "--eval-samples", "8192")
_SYNC = ("--consistency", "sync", "--dense", "allreduce")
# As in `rpcps bench ctr`: a rows cache of 1 % of the biggest table, each copy serving up to 10
# steps; and the hot rows replicated among the trainers, exact.
_CACHE = ("--cache-rows", "10000", "--cache-staleness", "10")
_HOT = ("--cache-rows", "2000", "--cache-staleness", "0")

SPEC = WorkloadSpec(
    name="ctr",
    help="parameter servers and click-through-rate (DLRM) trainers",
    leader="ps0",
    rank=20,
    roles=(RoleSpec("ctr", "trainer.ctr.config:CtrTrainerConfig", "trainer.ctr.status:CtrStatus",
                    "trainer.ctr.role:CtrTrainer", "run one click-through-rate trainer", episodes=True,
                    metric_families="trainer.ctr.metrics:CtrMetrics",
                    routes="trainer.core.routes:add_routes",
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
          BenchSpec("ratings", "generated movie-rating samples (user, movie, genre list, numeric columns) as CSV or "
                               "Parquet",
                    "trainer.ctr.datagen_ratings"),
          BenchSpec("check", "read data files as a feature schema says: each column's cardinality, missing rate "
                             "and list lengths", "trainer.ctr.datacheck")),
    commands=(BenchSpec("export", "a checkpoint's model as a folder a program loads without servers "
                                  "(rpcps.load_model): every table whole, the dense weights, the schema",
                        "trainer.ctr.export"),),
    benches=(BenchSpec("ctr", "samples/s, AUC and memory: one process vs async, sync, sync-allreduce and hybrid "
                              "servers",
                       "trainer.ctr.bench"),
             BenchSpec("serve", "rpcps serve, snapshot and online: latency of one row, rows/s batched, "
                                "freshness, and what it costs training beside it", "trainer.ctr.serving.bench"),
             BenchSpec("cache", "a trainer's rows cache alone on generated Criteo batches: hit rate per table by "
                                "ids and by lookups, milliseconds a step", "trainer.ctr.bench_cache"),
             BenchSpec("read", "a schema's files read as a trainer reads them: records/s from CSV and from Parquet, "
                               "the same records", "trainer.ctr.bench_read"),
             BenchSpec("stream", "event to prediction: files landing in a followed folder, seconds until /predict "
                                 "answers with a model trained on each", "trainer.ctr.bench_stream"),
             BenchSpec("reshard", "servers added to and removed from a training job live, against a stop and "
                                  "a start on the new count: the trainers' longest step, samples/s, bytes moved",
                       "trainer.ctr.bench_reshard"),
             BenchSpec("embeddings", "a hashed table against a plain one in one server: rows/s, bytes a row, "
                                     "eviction", "ps.server.hashed.bench")),
    scale=(ScaleCase("ctr-sync", "the built-in DLRM in sync, its MLPs replicated and all-reduced", (*_DLRM, *_SYNC),
                     "samples", "auc", efficiency=0.85, exact=True),
           ScaleCase("ctr-async", "the built-in DLRM in async, its MLPs on the servers", _DLRM, "samples", "auc",
                     efficiency=0.9, serve_rows="trainer.ctr.scale:rows", serve_flags=("--serve", "1")),
           ScaleCase("ctr-hybrid", "the built-in DLRM in hybrid: its tables async, its MLPs replicated and "
                                   "all-reduced", (*_DLRM, "--consistency", "hybrid"), "samples", "auc",
                     efficiency=0.9, quality_near=("ctr-sync", 0.002)),
           # Its steps are short: 4,096 samples a step, so that a step is more than its round trips.
           ScaleCase("movies", "the DeepFM of examples/ over generated movie ratings, in async",
                     ("--workload", "ctr", "--batch-size", "4096", "--eval-samples", "8192"), "samples", "auc",
                     prepare="trainer.ctr.scale:movies"),
           ScaleCase("ctr-async-multiplexed", "ctr-async with TensorPipe's multiplexed channel between hosts (its "
                                              "default)", (*_DLRM, "--rpc-channel", "multiplexed"), "samples", "auc",
                     against="ctr-async"),
           ScaleCase("ctr-async-prefetch", "ctr-async reading each step's rows while the step before computes",
                     (*_DLRM, "--prefetch", "1"), "samples", "auc", against="ctr-async"),
           ScaleCase("ctr-async-cache", "ctr-async with a rows cache on each trainer", (*_DLRM, *_CACHE), "samples",
                     "auc", against="ctr-async"),
           ScaleCase("ctr-async-prefetch-cache", "ctr-async with both", (*_DLRM, "--prefetch", "1", *_CACHE),
                     "samples", "auc", against="ctr-async", link_target=1.2),
           ScaleCase("ctr-sync-prefetch", "ctr-sync reading each step's rows the moment the step before is applied, "
                                          "while the step clock lets the step begin (exact)",
                     (*_DLRM, *_SYNC, "--prefetch", "1"), "samples", "auc", against="ctr-sync"),
           ScaleCase("ctr-sync-hot", "ctr-sync with the hot rows replicated among the trainers (exact)",
                     (*_DLRM, *_SYNC, *_HOT), "samples", "auc", against="ctr-sync", link_target=1.2)),
    examples=(("--workload ctr --steps 200 --scale 0.01", "a DLRM on generated data at 1 % of Criteo's rows: "
                                                          "held-out AUC beside the best possible"),
              ("--workload ctr --data day_0.gz --steps 1000", "Criteo-format files, streamed"),
              ("--workload ctr --consistency sync --dense allreduce", "the MLPs on the trainers, all-reduced"),
              ("--workload ctr --consistency hybrid", "the tables async, the MLPs on the trainers, all-reduced"),
              ("--workload ctr --tables hashed --table-capacity 20000 --admit-after 2",
               "tables keyed by raw 64-bit ids, within a capacity"),
              ("--workload ctr --model mypkg.models:MyModel --schema features.yaml --data dir/",
               "your model and your columns"),
              ("--workload ctr --serve 1", "and a serving member answering POST /predict from the live servers")),
)
