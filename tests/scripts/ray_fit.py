"""A Ray Train driver: ``JaxTrainer`` runs tests/scripts/engine_fit.py's ``train`` on 2 CPU workers
(each a process with 2 fake CPU devices), which join one ``jax.distributed`` job through trainkit.

    python tests/scripts/ray_fit.py RAY_ADDRESS STORAGE OUT.npz [OPTIONS_JSON]

``OPTIONS_JSON`` holds engine_fit's ``train`` arguments and ``max_failures`` (default 1).

Environment variables reach the workers through ``runtime_env`` (those of the driver do not).
``max_failures=1`` lets Ray restart the worker group once: a worker that dies is replaced.
"""

import json
import os
import pathlib
import sys

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer

SCRIPTS = pathlib.Path(__file__).resolve().parent
#: the driver's variables the workers get
WORKER_ENV = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "PYTHONUNBUFFERED")
WORKER_ENV += ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "TRAINKIT_COMPILATION_CACHE")


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
            name="trainkit", storage_path=storage, failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
