"""A Ray Train driver: ``JaxTrainer`` runs tests/scripts/engine_fit.py's ``train`` on 2 CPU workers
(each a process with 2 fake CPU devices), which join one ``jax.distributed`` job through trainkit.

    python tests/scripts/ray_fit.py RAY_ADDRESS STORAGE OUT.npz [OPTIONS_JSON]

``OPTIONS_JSON`` holds engine_fit's ``train`` arguments and ``max_failures`` (default 1). What Ray
recorded goes to ``OUT.npz.ray.json``: every report's metrics (rank 0's, as a ``UserCallback`` on
Ray's controller receives them), the checkpoints' names and the last one's.

Environment variables reach the workers through ``runtime_env`` (those of the driver do not).
``max_failures=1`` lets Ray restart the worker group once: a worker that dies is replaced.
"""

import json
import os
import pathlib
import sys

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.callback import UserCallback
from ray.train.v2.jax import JaxTrainer

SCRIPTS = pathlib.Path(__file__).resolve().parent
#: the driver's variables the workers get
WORKER_ENV = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "PYTHONUNBUFFERED")
WORKER_ENV += ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "TRAINKIT_COMPILATION_CACHE")
WORKER_ENV += ("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")  # Ray's controller


class RecordReports(UserCallback):
    """Appends each report's metrics (rank 0's) and checkpoint name to a JSON-lines file (on Ray's
    controller, the driver's machine here)."""

    def __init__(self, path: str):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint) -> None:
        name = os.path.basename(checkpoint.path) if checkpoint else None
        with open(self.path, "a") as f:
            f.write(json.dumps({"metrics": metrics[0], "checkpoint": name}, default=float) + "\n")


def train_loop_per_worker(config: dict) -> None:
    import engine_fit  # on the workers' PYTHONPATH (runtime_env)

    engine_fit.train(**config)


def main() -> int:
    address, storage, out = sys.argv[1:4]
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    max_failures = options.pop("max_failures", 1)
    env = {name: os.environ[name] for name in WORKER_ENV if name in os.environ}
    ray.init(address=address, runtime_env={"env_vars": env | {"PYTHONPATH": str(SCRIPTS)}}, log_to_driver=True)
    trainer = JaxTrainer(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config={"out": out, **options},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="trainkit",
            storage_path=storage,
            failure_config=FailureConfig(max_failures=max_failures),
            callbacks=[RecordReports(out + ".reports.jsonl")],
        ),
    )
    result = trainer.fit()
    reports = pathlib.Path(out + ".reports.jsonl")
    recorded = {
        "reports": [json.loads(line) for line in reports.read_text().splitlines()] if reports.exists() else [],
        "checkpoint": os.path.basename(result.checkpoint.path) if result.checkpoint else None,
        "checkpoints": sorted(os.path.basename(c.path) for c, _ in result.best_checkpoints),
    }
    pathlib.Path(out + ".ray.json").write_text(json.dumps(recorded, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
