"""Weight files that must not be trusted (issue 46): a malformed safetensors file is refused as
safetensors' own reader refuses it, naming the file and the tensor, before anything is placed; a
broken, empty or foreign source gets one line naming it and what to do; a weight of another rank
under ``layout="torch"`` is reported as mismatched, and ``strict=False`` loads the rest."""

import json
import re
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

import trainkit as tk
from trainkit.weights import WeightFileError

KERNEL = np.arange(6, dtype=np.float32).reshape(2, 3)
INTO = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}


def write(path, header: dict, data: bytes) -> str:
    """A safetensors file from a header and data, as the format lays them out."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def two(a=(0, 16), b=(16, 32), shape_b=(4,), data=bytes(32)) -> dict:
    return {"a": {"dtype": "F32", "shape": [4], "data_offsets": list(a)},
            "b": {"dtype": "F32", "shape": list(shape_b), "data_offsets": list(b)}}  # fmt: skip


def test_a_valid_file_written_by_hand_loads(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes()
    loaded = tk.weights.load(write(tmp_path / "ok.safetensors", two(), data), into=INTO)
    np.testing.assert_array_equal(loaded.tree["b"], np.arange(4, 8, dtype=np.float32))


@pytest.mark.parametrize(
    "header, data, reason",
    [
        (two(b=(16, 24)), bytes(24), r"entry 'b' spans bytes 16 to 24 of 24, where its shape \(4,\) of F32 needs 16"),
        (two(b=(-16, 0)), bytes(32), r"entry 'b' has shape \[4\] and data_offsets \[-16, 0\], not non-negative"),
        (two(b=(0, 16)), bytes(32), r"entry '[ab]' \(bytes 0 to 16\) overlaps '[ab]'"),
        (two(b=(20, 36)), bytes(36), r"entry 'b' \(bytes 20 to 36\) leaves bytes 16 to 20 unused"),
        (two(b=(24, 16)), bytes(32), r"entry 'b' spans bytes 24 to 16"),
        (two(b=(16, 48)), bytes(32), r"entry 'b' spans bytes 16 to 48 of 32"),
        (two(), bytes(40), r"its tensors end at byte 32 of its 40 bytes of data"),
        ({"a": {"dtype": "F32", "shape": [4]}}, bytes(16), r"entry 'a' lacks its dtype, shape or data_offsets"),
        ({"a": [1, 2]}, bytes(16), r"entry 'a' lacks"),
    ],
    ids=["short", "negative", "same-bytes", "gap", "reversed", "past-end", "trailing", "no-offsets", "not-a-dict"],
)
def test_a_malformed_safetensors_file_is_refused_naming_the_tensor(tmp_path, header, data, reason):
    path = write(tmp_path / "bad.safetensors", header, data)
    for strict in (True, False):
        with pytest.raises(WeightFileError, match=rf"bad.safetensors is not a valid safetensors file: {reason}"):
            tk.weights.load(path, into=INTO, strict=strict)


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", r"it is 0 bytes long, shorter than the 8 bytes"),
        (b"1234567", r"it is 7 bytes long"),
        (struct.pack("<Q", 2**62) + b"{}", r"its header would be 4611686018427387904 bytes long, in a file of 10"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", r"its header is not JSON"),
        (struct.pack("<Q", 5) + b"{abc}", r"its header is not JSON"),
        (struct.pack("<Q", 6) + b"[1, 2]", r"its header is a JSON list, not an object of tensors"),
    ],
    ids=["empty", "7-bytes", "huge-header", "not-utf8", "not-json", "a-list"],
)
def test_a_broken_file_gets_one_line_naming_it(tmp_path, content, reason):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightFileError, match=rf"broken.safetensors is not a valid safetensors file: {reason}") as e:
        tk.weights.load(path, into=INTO)
    assert "\n" not in str(e.value) and "write the file again" in str(e.value)


def test_a_truncated_file_is_refused(tmp_path):
    save_file({"w": KERNEL}, tmp_path / "w.safetensors")
    whole = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(whole[:-5])
    with pytest.raises(WeightFileError, match=r"entry 'w' spans bytes 0 to 24 of 19"):
        tk.weights.load(tmp_path / "w.safetensors", into={"w": np.zeros((2, 3), np.float32)})


def test_folders_and_files_that_hold_no_weights_are_named(tmp_path, data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightFileError, match=r"No weights in the folder .*empty \(it is empty; no .safetensors"):
        tk.weights.load(tmp_path / "empty", into=INTO)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("weights elsewhere")
    with pytest.raises(WeightFileError, match=r"\(it holds README.md; no .safetensors file"):
        tk.weights.load(tmp_path / "notes", into=INTO)
    for name in ("model.pt", "pytorch_model.bin"):
        (tmp_path / name).write_bytes(b"PK\x03\x04 a zip of pickles")
        with pytest.raises(WeightFileError, match=rf"{name} is a PyTorch pickle, which trainkit does not read"):
            tk.weights.load(tmp_path / name, into=INTO)
    np.savez(tmp_path / "objects.npz", w=np.array([{"a": 1}], dtype=object))
    with pytest.raises(WeightFileError, match=r"objects.npz is not a readable .npz of arrays .*Object arrays"):
        tk.weights.load(tmp_path / "objects.npz", into=INTO)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(WeightFileError, match=r"junk.npz is not a readable .npz"):
        tk.weights.load(tmp_path / "junk.npz", into=INTO)


def test_a_trainkit_checkpoint_as_the_source_points_to_trainer_load(tmp_path, data):
    import flax.linen as nn
    import optax

    trainer = tk.Trainer(
        nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    trainer.init(data[0][:4])
    trainer.save(tmp_path / "ck")
    for source in (tmp_path / "ck", tmp_path / "ck" / "0"):
        with pytest.raises(WeightFileError, match=r"is a trainkit checkpoint .*load it with trainer.load\("):
            tk.weights.load(source, into=trainer)


@pytest.mark.parametrize("stored", [(3,), (3, 2, 1)], ids=["1-D", "3-D"])
def test_a_torch_weight_of_another_rank_is_reported_and_strict_false_loads_the_rest(tmp_path, stored):
    """A Dense kernel (2, 3) whose file entry ``head.weight`` has another rank: no transpose fits.
    The report quotes the shape as stored; ``strict=False`` loads the bias."""
    path = tmp_path / "torch.safetensors"
    save_file({"head.weight": np.ones(stored, np.float32), "head.bias": np.full(3, 7, np.float32)}, path)
    into = {"head": {"kernel": np.zeros((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    quoted = f"head/kernel: shape {stored} in the source (as stored), (2, 3) in the model"
    with pytest.raises(ValueError, match=re.escape(quoted)):
        tk.weights.load(path, into=into, layout="torch")
    loaded = tk.weights.load(path, into=into, layout="torch", strict=False)
    assert loaded.report.mismatched == (("head/kernel", stored, (2, 3)),)
    np.testing.assert_array_equal(loaded.tree["head"]["bias"], np.full(3, 7, np.float32))
    np.testing.assert_array_equal(loaded.tree["head"]["kernel"], np.zeros((2, 3), np.float32))


def test_a_staging_folder_left_by_a_kill_is_removed_by_the_next_write(tmp_path, data):
    """A ``save_weights`` killed with SIGKILL half-way leaves its staging folder; the next write
    to the same file removes it (and one of an older trainkit, unnamed, once an hour old), keeps
    a live writer's, and the old file survives the kill whole."""
    import os
    import subprocess
    import sys
    import time

    import flax.linen as nn
    import optax

    from trainkit.distributed import atomic

    target = tmp_path / "w.safetensors"
    target.write_bytes(b"the previous weights")
    killed = (
        "import os; from trainkit.distributed import atomic\n"
        f"with atomic.staged({str(target)!r}) as t:\n"
        "    open(t, 'wb').write(b'half'); os.kill(os.getpid(), 9)"
    )
    result = subprocess.run([sys.executable, "-c", killed], capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr
    left = [p.name for p in tmp_path.iterdir() if ".writing-" in p.name]
    assert len(left) == 1 and target.read_bytes() == b"the previous weights"
    legacy, young = tmp_path / ".w.safetensors.writing-abcd1234", tmp_path / ".w.safetensors.writing-efgh5678"
    legacy.mkdir(), young.mkdir()
    os.utime(legacy, (time.time() - 2 * atomic.UNNAMED_STALE_SECONDS,) * 2)
    live = tmp_path / f".w.safetensors.writing-{os.getpid()}@{atomic._host()}-ijkl9012"
    live.mkdir()
    trainer = tk.Trainer(
        nn.Dense(3), loss="sparse_categorical_crossentropy", optimizer=optax.sgd(0.1), strategy="single"
    )
    trainer.init(data[0][:4])
    trainer.save_weights(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, live.name, "w.safetensors"])


def test_fuzzed_safetensors_headers_give_a_named_error_or_the_right_values(tmp_path):
    """#59: a few hundred mutations of a valid header (a fixed seed): each file loads the values it
    holds or raises a ``WeightFileError`` / ``ValueError`` naming it; never a bare Python error."""
    import json
    import random
    import struct

    import safetensors.numpy

    arrays = {"fc/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "fc/bias": np.ones(3, np.float32)}
    good = tmp_path / "good.safetensors"
    safetensors.numpy.save_file(arrays, good)
    blob = good.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8 : 8 + length]), blob[8 + length :]
    into = {"fc": {"kernel": np.zeros((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    odd_values = [None, True, -1, 2**63, 2**70, 1.5, "x", [], [1, [2]], {"a": 1}, ["F32"], [2**64, 1], "F32"]
    rng = random.Random(58)

    def deep(depth):
        return "[" * depth + "]" * depth

    for case in range(300):
        mutated = json.loads(json.dumps(header))
        raw = None
        kind = case % 4
        entry = mutated[rng.choice(["fc/kernel", "fc/bias"])]
        if kind == 0:  # a field of an entry replaced by a value of another type
            entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(odd_values)
        elif kind == 1:  # one number of a shape or offsets changed
            field = entry[rng.choice(["shape", "data_offsets"])]
            field[rng.randrange(len(field))] = rng.choice([0, 1, 5, 24, 2**31, 2**63 - 1, 2**63, -3])
        elif kind == 2:  # a field dropped, or the header made something else
            choice = rng.randrange(3)
            if choice == 0:
                del entry[rng.choice(["dtype", "shape", "data_offsets"])]
            elif choice == 1:
                raw = deep(rng.choice([10, 5000, 200_000])).encode()
            else:
                mutated = rng.choice([[], 3, "x", None])
        else:  # bytes of the header flipped
            encoded = bytearray(json.dumps(mutated).encode())
            for _ in range(rng.randrange(1, 4)):
                encoded[rng.randrange(len(encoded))] = rng.randrange(256)
            raw = bytes(encoded)
        raw = raw if raw is not None else json.dumps(mutated).encode()
        path = tmp_path / f"m{case}.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        try:
            loaded = tk.weights.load(path, into=into)
        except ValueError as error:  # WeightFileError, or the strict report: each names the file
            assert str(path) in str(error) or "do not match the model" in str(error), (case, error)
            continue
        for name, value in arrays.items():  # a mutation that still reads: the file's own values
            np.testing.assert_array_equal(loaded.tree["fc"][name.split("/")[1]], value)
