"""Checkpoints: bitwise round trip, crash safety at every os.replace, manifest checks, pruning."""

import dataclasses
import os

import numpy as np
import pytest

from rlportable.model.load import load_model
from rlportable.model.tiny import tiny_model
from rlportable.train import checkpoint as ckpt
from rlportable.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _optimizer(seed=0):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((4, 3)).astype(np.float32)
    special = np.array([0x7FC00001, 0xFFC00123, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001],
                       dtype=np.uint32).view(np.float32)  # NaN payloads, -0, +-inf, denormal
    return {"exp_avg.w": m, "exp_avg_sq.w": special, "step": np.array(seed * 7 + 3, dtype=np.int64),
            "counts": np.arange(5, dtype=np.int64)[::-1]}


def _state(step):
    return {"scheduler": {"lr": 1e-4, "step": step}, "data_position": step * 8,
            "rng": {"numpy": [1, 2, 3, 2**63 - 1], "python": list(range(5))}, "metrics": {"loss": 0.5}}


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _flip_byte(target):
    """One bit of the file's middle byte flipped in place."""
    with open(target, "rb") as handle:
        data = bytearray(handle.read())
    data[len(data) // 2] ^= 0x01
    with open(target, "wb") as handle:
        handle.write(bytes(data))


def _save(directory, step, model, **kw):
    config, weights, tokenizer = model
    return save_checkpoint(directory, step, config, weights, tokenizer, _optimizer(step), _state(step), **kw)


def test_round_trip_bitwise(tmp_path, model):
    config, weights, tokenizer = model
    path = _save(tmp_path, 123, model)
    assert os.path.basename(path) == "step-000123"
    assert (tmp_path / "latest").read_text().strip() == "step-000123"
    for loaded in (load_checkpoint(tmp_path), load_checkpoint(path)):
        assert loaded.step == 123
        assert loaded.trainer_state == _state(123)
        assert loaded.optimizer_state.keys() == _optimizer(123).keys()
        for name, array in _optimizer(123).items():
            assert _same_bits(loaded.optimizer_state[name], array), name
        want, got = weights.named_tensors(config), loaded.weights.named_tensors(loaded.config)
        assert want.keys() == got.keys()
        for name in want:
            assert _same_bits(want[name], got[name]), name
        assert loaded.weights.tied == weights.tied
        # weights are stored fp32 (every bit), so only the recorded torch_dtype differs
        assert dataclasses.replace(loaded.config, torch_dtype=config.torch_dtype) == config
        assert loaded.tokenizer.encode("hello world") == tokenizer.encode("hello world")
    # the step directory is also a plain model directory (--model)
    _, w2, _ = load_model(path)
    assert _same_bits(w2.embed, weights.embed)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_crash_at_every_replace_keeps_previous(tmp_path, model, monkeypatch):
    _save(tmp_path, 1, model)
    real_replace = os.replace
    stage = 0
    while True:
        calls = {"n": 0}

        def failing(src, dst, *a, calls=calls, stage=stage, **k):
            calls["n"] += 1
            if calls["n"] == stage + 1:
                raise OSError(f"simulated crash at replace #{calls['n']}")
            return real_replace(src, dst, *a, **k)

        monkeypatch.setattr(os, "replace", failing)
        try:
            _save(tmp_path, 2, model)
            crashed = False
        except OSError:
            crashed = True
        finally:
            monkeypatch.setattr(os, "replace", real_replace)
        if not crashed:
            break
        assert (tmp_path / "latest").read_text().strip() == "step-000001", stage
        loaded = load_checkpoint(tmp_path)
        assert loaded.step == 1 and loaded.trainer_state == _state(1)
        if (tmp_path / "step-000002").exists():  # only ever the complete new one
            assert load_checkpoint(tmp_path / "step-000002").step == 2
        stage += 1
    assert stage >= 5  # weights, config, tokenizer x2, optimizer, state, manifest, dir, latest
    assert load_checkpoint(tmp_path).step == 2
    assert list_checkpoints(tmp_path) == [1, 2]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_crash_mid_file_write(tmp_path, model, monkeypatch):
    _save(tmp_path, 1, model)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "sha256", boom)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model)
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == [1]
    assert load_checkpoint(tmp_path).step == 1


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.safetensors", "trainer_state.json",
                                    "tokenizer.json", "config.json"])
def test_corruption_detected(tmp_path, model, victim):
    path = _save(tmp_path, 5, model)
    _flip_byte(os.path.join(path, victim))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert victim in message and "corrupt" in message and "\n" not in message


@pytest.mark.parametrize("victim", ["model.safetensors", "tokenizer.json", "config.json"])
def test_model_from_a_step_directory_is_checked_against_its_manifest(tmp_path, model, victim):
    """--model DIR/step-N (load_model) verifies the manifest as --resume does: a flipped byte is
    one line naming the file, never a silent score; an intact step directory loads bitwise."""
    from rlportable.model import ModelError

    path = _save(tmp_path, 5, model)
    _, weights, _ = load_model(path)
    assert _same_bits(weights.embed, model[1].embed)
    _flip_byte(os.path.join(path, victim))
    with pytest.raises(ModelError) as info:
        load_model(path)
    message = str(info.value)
    assert victim in message and "corrupt" in message and "\n" not in message


def test_missing_and_partial(tmp_path, model):
    path = _save(tmp_path, 5, model)
    os.remove(os.path.join(path, "optimizer.safetensors"))
    with pytest.raises(CheckpointError, match="optimizer.safetensors: missing"):
        load_checkpoint(tmp_path)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        load_checkpoint(path)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no such"):
        load_checkpoint(tmp_path / "nope")


def test_latest_missing_falls_back_to_highest(tmp_path, model):
    _save(tmp_path, 3, model)
    _save(tmp_path, 4, model)
    os.remove(tmp_path / "latest")
    assert load_checkpoint(tmp_path).step == 4


def test_pruning_keeps_latest(tmp_path, model):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, keep_last=2)
    assert list_checkpoints(tmp_path) == [3, 4]
    # resuming from an older step: a later save names a lower step; it is never pruned
    _save(tmp_path, 2, model, keep_last=1)
    assert (tmp_path / "latest").read_text().strip() == "step-000002"
    assert list_checkpoints(tmp_path) == [2, 4]
    assert load_checkpoint(tmp_path).step == 2
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_overwrite_stale_step_and_refuse_latest(tmp_path, model):
    _save(tmp_path, 1, model)
    _save(tmp_path, 2, model)
    (tmp_path / "latest").write_text("step-000001\n")  # as after a crash before `latest` moved
    _save(tmp_path, 2, model)
    assert load_checkpoint(tmp_path).step == 2
    with pytest.raises(CheckpointError, match="already exists"):
        _save(tmp_path, 2, model)


def test_bad_inputs(tmp_path, model):
    config, weights, tokenizer = model
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path, 1, config, weights, tokenizer, {}, {"x": object()})
    with pytest.raises(CheckpointError, match="dtype"):
        save_checkpoint(tmp_path, 1, config, weights, tokenizer, {"a": np.array(["s"])}, {})
    with pytest.raises(CheckpointError, match="step"):
        save_checkpoint(tmp_path, -1, config, weights, tokenizer, {}, {})
    assert list_checkpoints(tmp_path) == []


def test_a_killed_latest_write_leaves_nothing_behind(tmp_path, model):
    _save(tmp_path, 1, model)
    stale = tmp_path / ".tmp-latest-abc123"  # what a kill between atomic_write's create and rename leaves
    stale.write_text("step-000001\n")
    (tmp_path / ".tmp-step-000002-xyz").mkdir()
    _save(tmp_path, 2, model)
    assert not stale.exists() and not (tmp_path / ".tmp-step-000002-xyz").exists()
    assert list_checkpoints(tmp_path) == [1, 2]


def test_checkpoint_files_follow_the_umask(tmp_path, model):
    from rlportable.model.weights import UMASK

    path = _save(tmp_path, 1, model)
    assert os.stat(path).st_mode & 0o777 == 0o777 & ~UMASK
    for name in os.listdir(path):
        assert os.stat(os.path.join(path, name)).st_mode & 0o777 == 0o666 & ~UMASK, name
    assert os.stat(tmp_path / "latest").st_mode & 0o777 == 0o666 & ~UMASK
