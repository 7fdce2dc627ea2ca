"""Ray Train: the digits CNN (examples/digits_cnn.py) on 2 CPU workers of a Ray cluster, as one
JAX job. The Trainer joins Ray's worker group by itself and reports each epoch to Ray, with
BackupAndRestore's backup as Ray's checkpoint; environment variables reach the workers through
``runtime_env`` (those of the driver do not).

    ray start --head --num-cpus=4            # or an existing cluster (RAY_ADDRESS)
    python examples/clusters/ray_digits.py --epochs 3 --backup /tmp/ray-results/digits-backup
"""

import pathlib
import sys

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent


def train_loop_per_worker(config: dict) -> None:
    import digits_cnn  # examples/ is on the workers' PYTHONPATH (runtime_env below)

    if digits_cnn.main(config["argv"]) != 0:
        raise RuntimeError("the digits CNN ended below its --min-accuracy")


def main(argv: list[str]) -> int:
    workers = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "PYTHONPATH": str(EXAMPLES)}
    ray.init(runtime_env={"env_vars": workers})
    trainer = JaxTrainer(
        train_loop_per_worker,
        train_loop_config={"argv": argv},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),  # use_gpu=True on GPUs
        run_config=RunConfig(storage_path="/tmp/ray-results", failure_config=FailureConfig(max_failures=1)),
    )
    result = trainer.fit()
    if result.checkpoint is not None:  # with --backup: the last epoch's backup, as Ray recorded it
        print(f"Ray recorded {result.checkpoint.path} with val_accuracy {result.metrics['val_accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
