"""Knowledge distillation on scikit-learn's digits: a teacher trained and saved by trainkit,
loaded into a frozen sub-tree of the distillation trainer, and a small student that learns from
the labels and the teacher's softened outputs (keras-io's "Knowledge Distillation", in trainkit).

    python examples/distillation.py --devices 8 --strategy fsdp

The distiller is one Flax module holding ``teacher`` and ``student``; ``trainable=r"^student/"``
freezes the teacher (no gradient, no optimizer state, its BatchNorm run in inference mode),
``tk.weights.load(..., into=trainer, prefix="teacher/")`` fills its sub-tree from the teacher's
file, and ``compute_loss`` logs ``student_loss`` and ``distillation_loss`` beside the loss. The
distiller's ``__call__`` is the student's, so ``predict`` and ``export`` give the student, and
``save_weights(..., prefix="student/")`` writes the student's weights alone. The script exits
non-zero when the student's held-out accuracy falls below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import flax.linen as nn
import jax
import numpy as np
import optax

import trainkit as tk


class Teacher(nn.Module):
    """A wide MLP with BatchNorm."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(256)(x)))
        return nn.Dense(10)(x)


class Student(nn.Module):
    """A narrow MLP: a tenth of the teacher's parameters."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(10)(x)


class Distiller(nn.Module):
    def setup(self):
        self.teacher, self.student = Teacher(), Student()

    def teach(self, x):
        return self.teacher(x, train=False)  # the teacher always predicts: its statistics never change

    def __call__(self, x):  # the student: what predict and export run
        if self.is_initializing():  # init creates the teacher's variables too
            self.teach(x)
        return self.student(x)


class DistillationTrainer(tk.Trainer):
    """``alpha`` of the labels' cross-entropy and ``1 - alpha`` of the KL divergence from the
    teacher's outputs softened by ``temperature`` (times its square, as Hinton et al. scale it)."""

    alpha, temperature = 0.1, 3.0

    def compute_loss(self, params, batch, rng, *, model_state, train):
        student, model_state = self.apply(params, model_state, batch["x"], rng=rng, train=train)
        teacher, _ = self.apply(params, model_state, batch["x"], rng=rng, train=False, method="teach")
        student_loss = optax.softmax_cross_entropy_with_integer_labels(student, batch["y"])
        t = self.temperature
        soft_teacher = jax.nn.softmax(jax.lax.stop_gradient(teacher) / t)
        distillation_loss = optax.kl_divergence(jax.nn.log_softmax(student / t), soft_teacher) * t**2
        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        logs = {"student_loss": student_loss, "distillation_loss": distillation_loss}
        return loss, (student, model_state, logs)


def digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's digits in [0, 1], shuffled, four fifths to train and a fifth held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = (data.data[order] / 16.0).astype(np.float32), data.target[order].astype(np.int32)
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def train_teacher(train, epochs: int, path: pathlib.Path, strategy: str) -> float:
    """The teacher trained on the labels and saved as safetensors; its training accuracy."""
    trainer = tk.Trainer(Teacher(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         metrics=["accuracy"], strategy=strategy)  # fmt: skip
    history = trainer.fit(*train, batch_size=64, epochs=epochs, verbose=0)
    trainer.save_weights(path)
    return history.history["accuracy"][-1]


def make_distiller(strategy: str = "single", **options) -> DistillationTrainer:
    return DistillationTrainer(Distiller(), optimizer=optax.adam(1e-2), metrics=["accuracy"], strategy=strategy,
                               trainable=r"^student/", **options)  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=0, help="fake this many CPU devices (0: the real ones)")
    parser.add_argument("--strategy", default="single", choices=["single", "dp", "fsdp"])
    parser.add_argument("--teacher-epochs", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="exit non-zero below this accuracy")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write teacher.safetensors, student.* here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)  # before anything touches a device
    out = args.out or pathlib.Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = digits()
    teacher_accuracy = train_teacher(train, args.teacher_epochs, out / "teacher.safetensors", args.strategy)
    trainer = make_distiller(args.strategy)
    trainer.init(train)
    report = tk.weights.load(out / "teacher.safetensors", into=trainer, prefix="teacher/")
    print(f"teacher: training accuracy {teacher_accuracy:.4f}; loaded {len(report.loaded)} variables")
    history = trainer.fit(*train, batch_size=64, epochs=args.epochs, verbose=0)
    print("logged", ", ".join(sorted(history.history)))
    accuracy = trainer.evaluate(*held_out, return_dict=True)["accuracy"]
    trainer.save_weights(out / "student.safetensors", prefix="student/")
    trainer.export(out / "student.jax", verbose=False)
    exported = tk.export.load(out / "student.jax")
    same = np.allclose(np.asarray(exported(held_out[0])), trainer.predict(held_out[0]), atol=1e-5)
    print(f"student held-out accuracy {accuracy:.4f}; exported student predicts as the trainer: {same}")
    return 0 if accuracy >= args.min_accuracy and same else 1


if __name__ == "__main__":
    sys.exit(main())
