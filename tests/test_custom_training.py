"""The user's own training logic (#58): losses that log their parts, an optimizer per
sub-network, a train step of one's own, each the same on every strategy."""

import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_example, strategy_table, subprocess_cache_env, tree_allclose
from flax import nnx

import trainkit as tk

ROOT = pathlib.Path(__file__).parent.parent


gan, vae, distillation = load_example("gan"), load_example("vae"), load_example("distillation")
STRATEGIES = strategy_table(min_shard_size=64)
IMAGES = gan.digits(200)  # with batch 64: three full batches and one of 8 real rows


def gan_adam():
    """The GAN's Adam, whose ``eps`` is above the last bit of a near-zero gradient: with the default 1e-8, a
    dead unit's gradient of 1e-9 in one summation order and 0 in another becomes a whole step of one run
    and none of the other (jax 0.12.1's Hybrid(data=2, fsdp=4) sums in another order: 6e-4 apart by epoch 3)."""
    return optax.adam(1e-3, b1=0.5, eps=1e-6)


def gan_trainer(strategy="single", **options):
    adam = gan_adam()
    return gan.GANTrainer(gan.GAN(), optimizer={"generator": adam, "discriminator": adam}, strategy=strategy, **options)


@pytest.fixture(scope="module")
def gan_single():
    trainer = gan_trainer(steps_per_execution=1)
    history = trainer.fit(IMAGES, batch_size=64, epochs=3, shuffle=False, verbose=0)
    return trainer, history.history


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name != "single"])
def test_gan_losses_and_parameters_match_single_device(gan_single, name):
    trainer = gan_trainer(STRATEGIES[name](), steps_per_execution=1)
    history = trainer.fit(IMAGES, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    reference, expected = gan_single
    assert list(history) == ["d_loss", "g_loss"]
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, err_msg=key)
    tree_allclose(trainer.params, reference.params, rtol=1e-4, atol=1e-5)


def test_gan_is_the_hand_written_optax_loop(gan_single):
    """The same GAN written with optax alone, from the trainer's initial state and rng: trainkit adds nothing."""
    reference, expected = gan_single
    trainer = gan_trainer()
    trainer.init(IMAGES[:64])
    state = trainer.state
    params, key, module = state.params, state.rng, gan.GAN()
    adam = gan_adam()
    parts = {name: params[name] for name in ("generator", "discriminator")}
    moments = {name: adam.init(part) for name, part in parts.items()}

    def run(parts, x, method):
        return module.apply({"params": parts}, x, method=method)

    @jax.jit
    def step(parts, moments, x, mask, rng):
        z = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(rng, i), (gan.LATENT,)))(jnp.arange(len(x)))
        mean = lambda values: (values * mask).sum() / mask.sum()  # noqa: E731

        def d_loss_fn(disc):
            both = {**parts, "discriminator": disc}
            fake = run(both, z, "generate")
            return mean(gan.bce(run(both, x, "discriminate"), 1.0) + gan.bce(run(both, fake, "discriminate"), 0.0))

        d_loss, grads = jax.value_and_grad(d_loss_fn)(parts["discriminator"])
        updates, moments["discriminator"] = adam.update(grads, moments["discriminator"])
        parts = {**parts, "discriminator": optax.apply_updates(parts["discriminator"], updates)}

        def g_loss_fn(generator):
            both = {**parts, "generator": generator}
            return mean(gan.bce(run(both, run(both, z, "generate"), "discriminate"), 1.0))

        g_loss, grads = jax.value_and_grad(g_loss_fn)(parts["generator"])
        updates, moments["generator"] = adam.update(grads, moments["generator"])
        return {**parts, "generator": optax.apply_updates(parts["generator"], updates)}, moments, d_loss, g_loss

    step_number, losses = 0, {"d_loss": [], "g_loss": []}
    for _ in range(3):
        sums, rows = np.zeros(2), 0
        for start in range(0, len(IMAGES), 64):
            x = np.zeros((64, 64), np.float32)
            real = IMAGES[start : start + 64]
            x[: len(real)] = real
            mask = (np.arange(64) < len(real)).astype(np.float32)
            parts, moments, d_loss, g_loss = step(parts, moments, x, mask, jax.random.fold_in(key, step_number))
            sums += len(real) * np.array([d_loss, g_loss])
            rows, step_number = rows + len(real), step_number + 1
        losses["d_loss"].append(sums[0] / rows)
        losses["g_loss"].append(sums[1] / rows)
    for name in losses:
        np.testing.assert_allclose(expected[name], losses[name], rtol=1e-6, err_msg=name)
    tree_allclose(reference.params, parts, rtol=1e-6, atol=1e-6)


def test_gan_fused_steps_equal_single_steps(gan_single):
    reference, expected = gan_single
    trainer = gan_trainer(steps_per_execution=8)
    history = trainer.fit(IMAGES, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    assert trainer.steps_per_execution == 8
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-6, err_msg=key)
    tree_allclose(trainer.params, reference.params, rtol=1e-6, atol=1e-7)


def test_gan_plan_counts_each_groups_optimizer_state():
    trainer = gan_trainer()
    plan = trainer.plan(IMAGES[:64], verbose=0)
    params = trainer.init(IMAGES[:64]).params
    for name in ("generator", "discriminator"):  # Adam: two moments per parameter, and a count
        size = sum(leaf.size * 4 for leaf in jax.tree.leaves(params[name]))
        assert plan.state_bytes[f"optimizer state ({name})"] == 2 * size + 4
    assert plan.state_bytes["optimizer state"] == 2 * sum(leaf.size * 4 for leaf in jax.tree.leaves(params)) + 8


def test_kill_9_mid_epoch_then_backup_and_restore_is_bit_identical(tmp_path):
    env = subprocess_cache_env()
    common = [sys.executable, str(ROOT / "examples" / "gan.py"), "--devices", "8", "--strategy", "dp", "--rows", "320"]
    common += ["--epochs", "4", "--batch-size", "32", "--min-improvement", "0"]
    # the uninterrupted reference runs beside the one killed (each is mostly its start and compile)
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "env": env}
    reference = subprocess.Popen([*common, "--out", str(tmp_path / "ref.npz")], **output)
    backup = tmp_path / "backup"
    run = [*common, "--backup", str(backup), "--out", str(tmp_path / "out.npz")]
    process = subprocess.Popen([*run, "--sleep", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    saved = lambda: [p for p in backup.glob("*") if p.name.isdigit() and (p / "commit_success.txt").exists()]  # noqa: E731
    deadline = 240
    while not [p for p in saved() if int(p.name) >= 14] and deadline > 0 and process.poll() is None:
        subprocess.run(["sleep", "0.1"])
        deadline -= 0.1
    process.kill()  # SIGKILL, mid-epoch 2 (10 steps an epoch)
    process.wait()
    steps = sorted(int(p.name) for p in saved())
    assert steps and steps[-1] < 40 and steps[-1] % 10, steps  # died mid-run, mid-epoch
    resumed = subprocess.run(run, capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    reference_output, _ = reference.communicate(timeout=240)
    assert reference.returncode == 0, reference_output
    with np.load(tmp_path / "ref.npz") as ref, np.load(tmp_path / "out.npz") as out:
        assert ref.files == out.files
        for name in ref.files:
            np.testing.assert_array_equal(ref[name], out[name], err_msg=name)


def vae_history(strategy):
    trainer = vae.VAETrainer(vae.VAE(), optimizer=optax.adam(1e-2), strategy=strategy)
    digits = vae.digits(200)
    history = trainer.fit(digits, batch_size=64, epochs=2, validation_data=(digits[:50],), verbose=0).history
    return history, trainer.evaluate(digits, return_dict=True)


@pytest.fixture(scope="module")
def vae_single():
    return vae_history("single")


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name != "single"])
def test_vae_loss_parts_are_logged_and_equal_on_every_strategy(vae_single, name):
    (expected, evaluated), (history, evaluation) = vae_single, vae_history(STRATEGIES[name]())
    keys = {"loss", "reconstruction_loss", "kl_loss"}
    assert set(history) == keys | {f"val_{key}" for key in keys}
    for key in history:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-6, err_msg=key)
    assert list(evaluation) == ["loss", "reconstruction_loss", "kl_loss"]  # the loss, then the parts in their order
    for key in evaluation:
        np.testing.assert_allclose(evaluation[key], evaluated[key], rtol=1e-6, err_msg=key)
    # each part is reduced as the loss: they sum to it
    np.testing.assert_allclose(evaluation["loss"], evaluation["reconstruction_loss"] + evaluation["kl_loss"], rtol=1e-6)


# ---------------------------------------------------------------------------------------------- errors
class Halves(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="left")(x) + nn.Dense(2, name="right")(x)


X, Y = np.ones((16, 3), np.float32), np.zeros((16,), np.int32)


def fit_with(trainer_class, optimizer=None, **options):
    optimizer = optimizer or {"left": optax.sgd(0.1), "right": optax.sgd(0.1)}
    trainer = trainer_class(Halves(), optimizer=optimizer, strategy="single", **options)
    return trainer.fit(X, Y, batch_size=8, epochs=1, verbose=0)


class Plain(tk.Trainer):
    def train_step(self, state, batch, rng):
        def loss_fn(params):
            out, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)
            return state.mean((out**2).sum(-1), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads, "left"), {"loss": loss}


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ({"left": optax.sgd(0.1)}, r"1 trainable parameter\(s\) match no key: \['right/bias'.*'right/kernel'"),
        ({"left": optax.sgd(0.1), "right": optax.sgd(0.1), "l": optax.sgd(0.1)}, r"match several keys.*left/bias"),
    ],
    ids=["unmatched", "doubly_matched"],
)
def test_an_optimizer_map_with_unmatched_or_doubly_matched_leaves_is_refused(optimizer, message):
    with pytest.raises(ValueError, match=message.replace("1 trainable", "2 trainable")):
        fit_with(Plain, optimizer)


def test_an_optimizer_map_trains_each_group_with_its_own_optimizer():
    trainer = tk.Trainer(
        Halves(), loss="sparse_categorical_crossentropy", strategy="single",
        optimizer={"left": optax.sgd(0.1), "right": optax.sgd(0.0)},
    )  # fmt: skip
    trainer.init((X, Y))
    before = jax.tree.map(np.asarray, trainer.params)
    trainer.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    after = trainer.params
    np.testing.assert_array_equal(after["right"]["kernel"], before["right"]["kernel"])  # a learning rate of 0
    assert not np.array_equal(after["left"]["kernel"], before["left"]["kernel"])


def test_apply_gradients_updates_only_its_group():
    trainer = Plain(Halves(), optimizer={"left": optax.adam(0.1), "right": optax.adam(0.1)}, strategy="single")
    trainer.init(X)
    before = jax.tree.map(np.asarray, trainer.get_weights())
    trainer.fit(X, batch_size=8, epochs=1, verbose=0)
    after = trainer.get_weights()
    np.testing.assert_array_equal(after["params"]["right"]["kernel"], before["params"]["right"]["kernel"])
    assert not np.array_equal(after["params"]["left"]["kernel"], before["params"]["left"]["kernel"])
    moments = trainer.state.opt_state.inner_states["right"].inner_state[0].mu["right"]["kernel"]
    assert not np.asarray(moments).any()  # the other group's state untouched


class UnknownGroup(Plain):
    def train_step(self, state, batch, rng):
        grads = jax.tree.map(jnp.zeros_like, state.params)
        return state.apply_gradients(grads, "middle"), {}


class WrongStructure(Plain):
    def train_step(self, state, batch, rng):
        return state


class VectorLogs(Plain):
    def train_step(self, state, batch, rng):
        return state, {"per_row": batch["x"].sum(-1)}


class UnknownMethod(Plain):
    def train_step(self, state, batch, rng):
        state.apply(state.params, state.model_state, batch["x"], rng=rng, train=True, method="decode")
        return state, {}


class KerasSignature(tk.Trainer):
    def train_step(self, state, data):  # Keras 3's JAX signature: never called silently
        return state, {}


@pytest.mark.parametrize(
    ("trainer_class", "error", "message"),
    [
        (UnknownGroup, ValueError, r"no optimizer group 'middle': the groups are \['left', 'right'\]"),
        (WrongStructure, TypeError, r"must return \(state, logs\).*received StepState"),
        (VectorLogs, ValueError, r"logs that are not scalars: \{'per_row': \(8,\)\}"),
        (UnknownMethod, ValueError, r"method='decode' is not a method of the model \(Halves\)"),
        (KerasSignature, TypeError, r"KerasSignature.train_step takes \(state, data\).*train_step\(self, state, batch"),
    ],
    ids=["unknown_group", "wrong_structure", "vector_logs", "unknown_method", "keras_signature"],
)
def test_wrong_use_of_a_custom_step_is_refused_before_the_first_step(trainer_class, error, message):
    with pytest.raises(error, match=message):
        fit_with(trainer_class)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grad_accum_steps": 2}, r"grad_accum_steps=2 with a train_step of your own"),
        ({"precision": "fp16"}, r"scales the loss \(fp16\).*Use precision='bf16'"),
        ({"skip_spikes": tk.SpikeSkip()}, r"skip_spikes with a train_step of your own"),
        ({"log_grad_norm": True}, r"log_grad_norm=True with a train_step of your own"),
    ],
    ids=["accumulation", "fp16", "skip_spikes", "grad_norm"],
)
def test_settings_a_custom_step_cannot_apply_are_refused_when_the_trainer_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        Plain(Halves(), optimizer=optax.sgd(0.1), strategy="single", **options)


def test_compute_loss_returning_another_structure_names_the_contract():
    class LossAlone(tk.Trainer):
        def compute_loss(self, params, batch, rng, *, model_state, train):
            out, _ = self.apply(params, model_state, batch["x"], rng=rng, train=train)
            return (out**2).sum(-1)

    with pytest.raises(TypeError, match=re.escape("compute_loss must return (per_example_loss, (predictions")):
        LossAlone(Halves(), optimizer=optax.sgd(0.1), strategy="single").fit(X, batch_size=8, verbose=0)


# ---------------------------------------------------------------------------------------------- add_loss, rates
class Penalised(nn.Module):
    """A Dense whose kernel's squared norm is sown as a loss (Keras's ``add_loss``), in two modules."""

    @nn.compact
    def __call__(self, x):
        for name in ("first", "second"):
            dense = nn.Dense(2, name=name)
            x = dense(x)
            self.sow("losses", "penalty", 0.01 * (dense.variables["params"]["kernel"] ** 2).sum())
        return x


@pytest.mark.parametrize("name", ["single", "dp8", "fsdp8"])
def test_sown_losses_are_added_to_the_loss_and_logged(name):
    x, y = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32), np.zeros(40, np.int32)
    trainer = tk.Trainer(Penalised(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         strategy=STRATEGIES[name]())  # fmt: skip
    history = trainer.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=0).history
    assert {"penalty", "val_penalty"} <= set(history) and "losses" not in trainer.state.model_state
    logs = trainer.evaluate(x, y, return_dict=True)
    kernels = [trainer.params[layer]["kernel"] for layer in ("first", "second")]
    penalty = sum(0.01 * float((kernel**2).sum()) for kernel in kernels)
    np.testing.assert_allclose(logs["penalty"], penalty, rtol=1e-5)  # both modules' values, summed
    out = trainer.predict(x)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    np.testing.assert_allclose(logs["loss"], cross_entropy + penalty, rtol=1e-5)  # and added to the loss


def test_each_groups_learning_rate_is_read_set_and_reduced_by_the_callbacks():
    rate = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    trainer = tk.Trainer(Halves(), loss="sparse_categorical_crossentropy", strategy="single",
                         optimizer={"left": rate, "right": rate})  # fmt: skip
    trainer.init((X, Y))
    trainer.learning_rate["right"] = 0.4
    assert dict(trainer.learning_rate) == pytest.approx({"left": 0.1, "right": 0.4})
    with pytest.raises(KeyError, match=r"no optimizer group 'middle'"):
        trainer.learning_rate["middle"]
    never_better = tk.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, mode="max", min_delta=1e9)
    history = trainer.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[never_better]).history
    # logged as each epoch ended, before the second epoch's end reduced both (as Keras logs it)
    assert history["learning_rate/left"] == pytest.approx([0.1, 0.1]) and "learning_rate" not in history
    assert dict(trainer.learning_rate) == pytest.approx({"left": 0.05, "right": 0.2})
    one = tk.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5, group="left")
    trainer.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[one])
    assert dict(trainer.learning_rate) == pytest.approx({"left": 0.025, "right": 0.2})
    trainer.learning_rate = 0.3  # every group's
    assert dict(trainer.learning_rate) == pytest.approx({"left": 0.3, "right": 0.3})


# ---------------------------------------------------------------------------------------------- a frozen teacher
@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    train, _ = distillation.digits()
    accuracy = distillation.train_teacher((train[0][:512], train[1][:512]), 3, path, "single")
    assert accuracy > 0.8
    return path


@pytest.mark.parametrize("name", ["single", "fsdp8"])
def test_a_loaded_frozen_teacher_has_no_optimizer_state_is_sharded_and_never_changes(teacher_file, name, tmp_path):
    (x, y), (held_x, held_y) = distillation.digits()
    x, y = x[:512], y[:512]
    trainer = distillation.make_distiller(STRATEGIES[name]())
    trainer.init((x, y))
    report = tk.weights.load(teacher_file, into=trainer, prefix="teacher/")
    assert len(report.loaded) == 8  # the teacher's 2 Dense, its BatchNorm's scale, bias, mean and var; nothing else
    teacher = jax.tree.map(np.asarray, {**trainer.params["teacher"],
                                        "batch_stats": trainer.get_weights()["batch_stats"]["teacher"]})  # fmt: skip
    loaded = tk.weights.load(teacher_file, into=teacher)  # the file's values, in the trainer's tree
    tree_allclose(teacher, loaded.tree, rtol=0, atol=0)
    # Adam's moments exist for the student alone (and the count)
    student_size = sum(np.size(leaf) for leaf in jax.tree.leaves(trainer.params["student"]))
    assert sum(np.size(leaf) for leaf in jax.tree.leaves(trainer.state.opt_state)) == 2 * student_size + 1
    kernel = trainer.state.params["teacher"]["Dense_0"]["kernel"]
    if name == "fsdp8":  # the frozen teacher is sharded as any parameter
        assert len({index for shard in kernel.addressable_shards for index in [str(shard.index)]}) == 8
    history = trainer.fit(x, y, batch_size=64, epochs=2, verbose=0).history
    assert {"student_loss", "distillation_loss", "accuracy"} <= set(history)
    after = {**trainer.params["teacher"], "batch_stats": trainer.get_weights()["batch_stats"]["teacher"]}
    tree_allclose(after, teacher, rtol=0, atol=0)  # bit-identical through training
    # the student alone: exported, and as weights a plain Student trainer reads
    trainer.export(tmp_path / "student.jax", verbose=False)
    np.testing.assert_allclose(tk.export.load(tmp_path / "student.jax")(held_x), trainer.predict(held_x), atol=1e-5)
    trainer.save_weights(tmp_path / "student.safetensors", prefix="student/")
    student = tk.Trainer(distillation.Student(), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1),
                         strategy="single")  # fmt: skip
    student.init((held_x, held_y))
    tk.weights.load(tmp_path / "student.safetensors", into=student)
    np.testing.assert_allclose(student.predict(held_x), trainer.predict(held_x), atol=1e-5)


def test_an_optimizer_for_the_frozen_teacher_is_refused():
    trainer = distillation.DistillationTrainer(
        distillation.Distiller(), strategy="single", trainable=r"^student/",
        optimizer={"student": optax.adam(1e-3), "teacher": optax.adam(1e-3)},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"keys that update no trainable parameter: 'teacher' \(only frozen"):
        trainer.init((np.zeros((8, 64), np.float32), np.zeros(8, np.int32)))


def test_loading_under_a_prefix_that_names_nothing_says_what_the_paths_are(teacher_file):
    trainer = distillation.make_distiller()
    trainer.init((np.zeros((8, 64), np.float32), np.zeros(8, np.int32)))
    with pytest.raises(ValueError, match=r"prefix='techer/' names no variable: .*'student/', 'teacher/'"):
        tk.weights.load(teacher_file, into=trainer, prefix="techer/")


class Body(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.relu(nn.Dense(64, name="body")(x)))


def test_groups_keep_offload_and_lora_working():
    """Each group's optimizer state streamed from host memory gives the same numbers; under LoRA
    the groups hold the adapters alone (the base frozen)."""
    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def trained(**options):
        trainer = tk.Trainer(Body(), loss="sparse_categorical_crossentropy", strategy=tk.FSDP(min_shard_size=16),
                             **options)  # fmt: skip
        trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
        return trainer

    groups = lambda: {"body": optax.adam(1e-2), "head": optax.sgd(0.1)}  # noqa: E731
    tree_allclose(trained(optimizer=groups(), offload="optimizer").params, trained(optimizer=groups()).params, 0, 0)
    adapted = trained(optimizer=groups(), lora=tk.LoRA(rank=2))
    moments = adapted.state.opt_state.inner_states["body"].inner_state[0].mu["body"]
    assert sorted(k for k, v in moments.items() if np.size(v) > 1) == ["kernel_lora_a", "kernel_lora_b"]


class JudgedGAN(gan.GANTrainer):
    def test_step(self, state, batch, rng):
        logits, _ = state.apply(
            state.params, state.model_state, batch["x"], rng=rng, train=False, method="discriminate"
        )
        return {"real_accuracy": state.mean((logits > 0).astype(jnp.float32), batch)}


def test_a_test_step_of_your_own_validates_and_evaluates_the_same_on_every_strategy():
    results = {}
    for name in ("single", "dp8"):
        adam = gan_adam()
        trainer = JudgedGAN(
            gan.GAN(), optimizer={"generator": adam, "discriminator": adam}, strategy=STRATEGIES[name]()
        )
        history = trainer.fit(IMAGES, batch_size=64, epochs=2, validation_data=(IMAGES[:100],), verbose=0).history
        results[name] = (history["val_real_accuracy"], trainer.evaluate(IMAGES[:100], return_dict=True))
    assert sorted(results["single"][1]) == ["real_accuracy"]
    np.testing.assert_allclose(results["dp8"][0], results["single"][0], rtol=1e-6)
    np.testing.assert_allclose(results["dp8"][1]["real_accuracy"], results["single"][1]["real_accuracy"], rtol=1e-6)


def test_validation_without_a_test_step_or_a_loss_is_refused_before_the_first_step():
    trainer = gan_trainer()
    with pytest.raises(NotImplementedError, match=r"evaluate and validation run test_step"):
        trainer.fit(IMAGES, batch_size=64, epochs=1, validation_data=(IMAGES[:64],), verbose=0)
    assert trainer.global_step == 0


def test_a_teacher_loads_from_a_trainkit_checkpoint_into_its_sub_tree(tmp_path):
    (x, y), _ = distillation.digits()
    teacher = tk.Trainer(distillation.Teacher(), loss="sparse_categorical_crossentropy", optimizer=optax.adam(1e-3),
                         strategy="single")  # fmt: skip
    teacher.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0)
    teacher.save(tmp_path / "teacher")  # the whole training state: its variables are read, nothing else
    trainer = distillation.make_distiller(tk.FSDP(min_shard_size=64))
    trainer.init((x[:64], y[:64]))
    student = jax.tree.map(np.asarray, trainer.params["student"])
    report = tk.weights.load(tmp_path / "teacher", into=trainer, prefix="teacher/")
    assert len(report.loaded) == 8
    tree_allclose(trainer.params["teacher"], teacher.params, rtol=0, atol=0)
    tree_allclose(trainer.get_weights()["batch_stats"]["teacher"], teacher.get_weights()["batch_stats"], 0, 0)
    tree_allclose(trainer.params["student"], student, rtol=0, atol=0)  # untouched


class NNXAutoEncoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.encoder, self.decoder = nnx.Linear(16, 4, rngs=rngs), nnx.Linear(4, 16, rngs=rngs)

    def encode(self, x):
        return self.encoder(x)

    def __call__(self, x):
        return self.decoder(self.encode(x))


class NNXSteps(tk.Trainer):
    def train_step(self, state, batch, rng):
        def loss_fn(params):
            code, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True, method="encode")
            out, _ = state.apply(params, state.model_state, batch["x"], rng=rng, train=True)
            return state.mean(((out - batch["x"]) ** 2).sum(-1) + 0.01 * (code**2).sum(-1), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads, "encoder")
        return state.apply_gradients(grads, "decoder"), {"loss": loss}


def test_an_nnx_module_gets_methods_groups_and_a_step_of_its_own():
    x = np.random.default_rng(0).normal(size=(100, 16)).astype(np.float32)
    losses = {}
    for name in ("single", "dp8"):
        trainer = NNXSteps(NNXAutoEncoder(nnx.Rngs(0)), strategy=STRATEGIES[name](),
                           optimizer={"encoder": optax.adam(1e-2), "decoder": optax.sgd(0.1)})  # fmt: skip
        losses[name] = trainer.fit(x, batch_size=32, epochs=2, verbose=0).history["loss"]
    assert losses["single"][1] < losses["single"][0]
    np.testing.assert_allclose(losses["dp8"], losses["single"], rtol=1e-6)
