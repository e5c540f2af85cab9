"""Atomic training checkpoints.

Layout of ``directory/``::

    step-000123/            one complete checkpoint (loads with load_model / --model)
        config.json  model.safetensors (fp32)  tokenizer.json  tokenizer_config.json
        optimizer.safetensors   name -> array, exact bits (any numeric dtype); written by R
                                data-parallel ranks: optimizer-RRRRR-of-NNNNN.safetensors, rank r's
                                pieces (train/optimizer.py shard_range); by T x R ranks of a
                                tensor-parallel run: optimizer-tpTTT-of-TTT-RRRRR-of-RRRRR.safetensors,
                                the pieces of the rank's tensor-parallel shards
        trainer_state.json      scheduler, data-order position, RNG states, metrics
        manifest.json           step, the shard count, SHA-256 and size of every other file (written last)
    latest                  text file naming the current step directory

save_checkpoint writes everything into a hidden sibling ``.tmp-step-...`` directory,
fsyncs every file and the directory, renames it into place with os.replace, fsyncs the
parent, then replaces ``latest`` (temp file + os.replace).  A crash at any point leaves
``latest`` naming either the previous checkpoint or the complete new one.  With a group of
ranks (one filesystem shared by all), rank 0 makes the temporary directory, every rank writes
its optimiser shard into it, and rank 0 writes the rest and publishes; a failure on any rank
is raised on every rank.  One run per checkpoint directory is assumed.  load_checkpoint
reads the optimiser state lazily (OptimizerShards): a rank reads only the elements it owns when
the checkpoint's tensor-parallel size is the run's; otherwise each whole tensor, one at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlportable.errors import RlpError
from rlportable.model.config import ModelConfig
from rlportable.model.manifest import MANIFEST, files_problem, sha256
from rlportable.model.tokenizer import Tokenizer
from rlportable.model import parallel
from rlportable.model.expert_parallel import ExpertParallel, expert_of, is_expert
from rlportable.model.weights import UMASK, ModelWeights, atomic_write, expected_tensors
from rlportable.runtime.collectives import Group, SingleGroup

LATEST = "latest"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
FORMAT = "rlportable-checkpoint-1"
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-step-"
_TRASH_PREFIX = ".trash-step-"
_TMP_LATEST_PREFIX = ".tmp-" + LATEST + "-"  # atomic_write's temporary file beside `latest`


class CheckpointError(RlpError):
    """A checkpoint is missing, partial, corrupt, or cannot be written."""


@dataclass(eq=False)
class Checkpoint:
    step: int
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    optimizer_state: "OptimizerShards"
    trainer_state: dict[str, Any]
    path: str


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def optimizer_file(rank: int, ranks: int, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0, ep: int = 1) -> str:
    """The optimiser shard of data-parallel rank `rank` of `ranks` (and tensor-parallel rank tp_rank of tp,
    expert-parallel rank ep_rank of ep)."""
    if ep > 1:
        return (f"optimizer-ep{ep_rank:03d}-of-{ep:03d}-tp{tp_rank:03d}-of-{tp:03d}-{rank:05d}-of-{ranks:05d}"
                ".safetensors")
    if tp > 1:
        return f"optimizer-tp{tp_rank:03d}-of-{tp:03d}-{rank:05d}-of-{ranks:05d}.safetensors"
    return OPTIMIZER_FILE if ranks == 1 else f"optimizer-{rank:05d}-of-{ranks:05d}.safetensors"


def optimizer_files(ranks: int, tp: int = 1, ep: int = 1) -> list[str]:
    return [optimizer_file(r, ranks, t, tp, e, ep) for e in range(ep) for t in range(tp) for r in range(ranks)]


class OptimizerShards:
    """The optimiser state of a checkpoint written at `ranks` data-parallel x `tp` tensor-parallel
    ranks, read lazily.

    state[key]: the whole array (one file's array as stored; else assembled from the shards: each
    tensor-parallel rank's flat pieces make its shard, the shards make the tensor). read(key, size,
    lo, hi): elements [lo, hi) of the flattened whole tensor; without tensor parallelism read from the
    shards that hold them only, so a run resumed at another replica count reads its own pieces.
    Written at `ep` expert-parallel ranks, each one's files are such a checkpoint of its experts and of
    the tensors every rank holds: a key is read from its expert's rank (the others from rank 0)."""

    def __init__(self, step_dir: str, ranks: int, tp: int = 1, config: ModelConfig | None = None, ep: int = 1,
                 ep_rank: int | None = None):
        from safetensors import SafetensorError, safe_open

        self.ranks, self.tp, self.config, self.ep = ranks, tp, config, ep
        self._parts = None
        if ep > 1 and ep_rank is None:
            self._parts = [OptimizerShards(step_dir, ranks, tp, config, ep, e) for e in range(ep)]
            self.paths = [path for part in self._parts for path in part.paths]
            return
        names = optimizer_files(ranks, tp) if ep == 1 else \
            [optimizer_file(r, ranks, t, tp, ep_rank, ep) for t in range(tp) for r in range(ranks)]
        self.paths = [os.path.join(step_dir, name) for name in names]
        self._open = safe_open
        self._lengths: list[dict[str, int]] = []
        self._flat: list[dict[str, bool]] = []
        for path in self.paths:
            try:
                with safe_open(path, framework="numpy") as handle:
                    shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys()}
            except (OSError, ValueError, TypeError, SafetensorError) as error:
                raise CheckpointError(f"{path}: unreadable: {' '.join(str(error).split())}") from None
            self._lengths.append({key: int(np.prod(shape, dtype=np.int64)) for key, shape in shapes.items()})
            self._flat.append({key: len(shape) == 1 for key, shape in shapes.items()})
        if any(lengths.keys() != self._lengths[0].keys() for lengths in self._lengths):
            raise CheckpointError(f"{self.paths[0]}: the optimiser shards hold different tensors")

    def keys(self):
        if self._parts is not None:
            return {key: None for part in self._parts for key in part.keys()}.keys()
        return self._lengths[0].keys()

    def _part(self, key: str) -> "OptimizerShards":
        """The expert-parallel rank's shards that hold `key` (self without expert parallelism)."""
        if self._parts is None:
            return self
        name = key.split(".", 1)[1]
        rank = ExpertParallel(0, self.ep).owner(expert_of(name), self.config.num_experts) if is_expert(name) else 0
        return self._parts[rank]

    def _tensor(self, index: int, key: str) -> np.ndarray:
        with self._open(self.paths[index], framework="numpy") as handle:
            return handle.get_tensor(key)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.keys():
            raise KeyError(key)
        if self._parts is not None:
            return self._part(key)[key]
        if len(self.paths) == 1:
            return self._tensor(0, key)
        if self.tp == 1:
            total = sum(lengths[key] for lengths in self._lengths)
            return self._range(range(self.ranks), key, total, 0, total)
        return self._whole(key).reshape(-1)

    def _whole(self, key: str) -> np.ndarray:
        """A tensor-parallel checkpoint's tensor, from every rank's shard (each from its pieces)."""
        name = key[2:]
        shape = expected_tensors(self.config)[name]
        shards = []
        for t in range(self.tp):
            local = parallel.shard_shape(self.config, parallel.TensorParallel(t, self.tp), name, shape)
            size = int(np.prod(local))
            shards.append(self.read_shard(key, t, size, 0, size).reshape(local))
        axis = parallel.tensor_axis(name)
        return shards[0] if axis is None else np.concatenate(shards, axis=axis)

    def read(self, key: str, size: int, lo: int, hi: int) -> np.ndarray:
        if key not in self.keys():
            raise CheckpointError(f"{self.paths[0]}: optimiser state {key} is missing")
        if self._parts is not None:
            return self._part(key).read(key, size, lo, hi)
        if self.tp > 1:
            whole = int(np.prod(expected_tensors(self.config)[key[2:]]))
            if whole != size:
                raise CheckpointError(f"{self.paths[0]}: optimiser state {key} has {whole} elements, the "
                                      f"model's tensor {size}")
            return self._whole(key).reshape(-1)[lo:hi]
        return self._range(range(len(self.paths)), key, size, lo, hi)

    def read_shard(self, key: str, tp_rank: int, size: int, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of tensor-parallel rank tp_rank's flattened shard of `key` (a checkpoint
        written at the same tensor-parallel size as the run reading it): from that rank's files only."""
        if key not in self.keys():
            raise CheckpointError(f"{self.paths[0]}: optimiser state {key} is missing")
        if self._parts is not None:
            return self._part(key).read_shard(key, tp_rank, size, lo, hi)
        return self._range(range(tp_rank * self.ranks, (tp_rank + 1) * self.ranks), key, size, lo, hi)

    def _range(self, files: range, key: str, size: int, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of the flat pieces `files` hold of `key`, one after another, read lazily."""
        lengths = [self._lengths[i][key] for i in files]
        if sum(lengths) != size:
            raise CheckpointError(f"{self.paths[files[0]]}: optimiser state {key} has {sum(lengths)} elements, the "
                                  f"model's tensor {size}")
        pieces, start = [], 0
        for index, length in zip(files, lengths):
            a, b = max(lo, start) - start, min(hi, start + length) - start
            if a < b:
                if self._flat[index][key]:
                    with self._open(self.paths[index], framework="numpy") as handle:
                        pieces.append(handle.get_slice(key)[a:b])
                else:
                    pieces.append(self._tensor(index, key).reshape(-1)[a:b])
            start += length
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


# ----------------------------------------------------------------------------- helpers


def _fsync_path(path: str) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # e.g. directories cannot be opened on Windows
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _files(root: str) -> list[str]:
    out = []
    for base, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            out.append(os.path.relpath(os.path.join(base, name), root).replace(os.sep, "/"))
    return out


def _encode_optimizer(state: dict[str, np.ndarray]) -> bytes:
    from safetensors import SafetensorError
    from safetensors.numpy import save

    tensors = {}
    for name, array in state.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"optimizer state key {name!r} is not a non-empty string")
        array = np.asarray(array)
        if array.dtype.kind not in "biuf":
            raise CheckpointError(f"optimizer state {name!r} has dtype {array.dtype}; need a numeric array")
        tensors[name] = np.array(array, dtype=array.dtype.newbyteorder("<"), order="C", copy=True)
    try:
        return save(tensors, metadata={"format": "rlportable-optimizer"})
    except (ValueError, TypeError, SafetensorError) as error:  # unsupported dtype and the like
        raise CheckpointError(f"cannot encode optimizer state: {' '.join(str(error).split())}") from None


def _step_dirs(directory: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _STEP_RE.match(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append((int(match.group(1)), name))
    return sorted(found)


def _read_latest(directory: str) -> str | None:
    path = os.path.join(directory, LATEST)
    try:
        with open(path, encoding="utf-8") as handle:
            name = handle.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable: {' '.join(str(error).split())}") from None
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{path}: does not name a step directory (got {name[:60]!r})")
    return name


def _remove_dir(directory: str, name: str) -> None:
    """Rename out of sight first (atomic), then delete, so no half-deleted step-* remains."""
    trash = tempfile.mkdtemp(dir=directory, prefix=_TRASH_PREFIX)
    target = os.path.join(trash, name)
    os.replace(os.path.join(directory, name), target)
    _fsync_path(directory)
    shutil.rmtree(trash, ignore_errors=True)


def _clean_stale(directory: str) -> None:
    """What a killed save leaves: its half-written step folder, a folder on its way out, and the
    temporary file of a `latest` being replaced (atomic_write's `.tmp-latest-*`)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(_TMP_LATEST_PREFIX) and os.path.isfile(path):
            try:
                os.unlink(path)
            except OSError:
                pass


# ----------------------------------------------------------------------------- public API


def list_checkpoints(directory: str | os.PathLike) -> list[int]:
    """Steps of the step-* directories in `directory`, ascending (not verified)."""
    return [step for step, _ in _step_dirs(os.fspath(directory))]


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """Path of the step directory `latest` names (or the highest step-* when there is no
    `latest` file), or None when `directory` holds no checkpoint."""
    directory = os.fspath(directory)
    name = _read_latest(directory)
    if name is None:
        dirs = _step_dirs(directory)
        if not dirs:
            return None
        name = dirs[-1][1]
    return os.path.join(directory, name)


def _together(groups: tuple, work: Callable[[], Any]) -> list:
    """work() on every rank of the groups (data-parallel, then tensor-parallel), then every rank's
    result, world rank 0's first; an error on any rank is raised on every rank (none is left waiting)."""
    groups = [group for group in groups if group.size > 1]
    if not groups:
        return [work()]
    try:
        outcome = (None, work())
    except CheckpointError as error:
        outcome = (str(error), None)
    except Exception as error:  # noqa: BLE001 - every rank must hear of it, or they wait forever
        outcome = (f"cannot write the checkpoint: {' '.join(str(error).split())}", None)
    outcomes = [outcome]
    for group in groups:
        outcomes = [item for part in group.all_gather_object(outcomes) for item in part]
    for message, _ in outcomes:
        if message is not None:
            raise CheckpointError(message)
    return [value for _, value in outcomes]


def save_checkpoint(directory: str | os.PathLike, step: int, config: ModelConfig, weights: ModelWeights | None,
                    tokenizer: Tokenizer, optimizer_state: dict[str, np.ndarray], trainer_state: dict,
                    keep_last: int | None = None, dp_group: Group | None = None, tp_group: Group | None = None,
                    ep_group: Group | None = None) -> str:
    """Write directory/step-NNNNNN atomically, point `latest` at it, optionally prune to the
    `keep_last` highest steps (never the latest). Returns the step directory's path.
    dp_group, tp_group, ep_group: the data-parallel, tensor-parallel and expert-parallel ranks of a sharded
    run, each passing its own optimizer_state (its pieces of its shards); rank 0's weights (whole),
    tokenizer and trainer state are written (the other ranks may pass weights=None)."""
    from rlportable.model.load import save_model

    dp_group, tp_group, ep_group = dp_group or SingleGroup(), tp_group or SingleGroup(), ep_group or SingleGroup()
    groups = (dp_group, tp_group, ep_group)
    leader, ranks = dp_group.rank == 0 and tp_group.rank == 0 and ep_group.rank == 0, dp_group.size
    directory = os.fspath(directory)
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
    step = int(step)
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1, got {keep_last}")
    try:
        state_text = json.dumps(trainer_state, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"trainer state is not JSON-serialisable: {error}") from None
    optimizer_bytes = _encode_optimizer(optimizer_state)
    name = step_dir_name(step)
    final = os.path.join(directory, name)

    def prepare() -> str:
        os.makedirs(directory, exist_ok=True)
        _clean_stale(directory)
        if _read_latest(directory) == name and os.path.exists(final):
            raise CheckpointError(f"{final}: already exists and is the latest checkpoint; not overwriting it")
        tmp = tempfile.mkdtemp(dir=directory, prefix=_TMP_PREFIX + f"{step:06d}-")
        os.chmod(tmp, 0o777 & ~UMASK)  # a folder's ordinary permissions, not mkdtemp's 0700 (see atomic_write)
        return tmp

    tmp = _together(groups, prepare if leader else lambda: None)[0]

    def write() -> None:
        atomic_write(os.path.join(tmp, optimizer_file(dp_group.rank, ranks, tp_group.rank, tp_group.size,
                                                      ep_group.rank, ep_group.size)),
                     [optimizer_bytes])
        if leader:
            save_model(tmp, config, weights, tokenizer, dtype="fp32")
            atomic_write(os.path.join(tmp, TRAINER_STATE_FILE), [state_text.encode("utf-8")])

    def publish() -> None:
        files = {}
        for rel in _files(tmp):
            path = os.path.join(tmp, rel)
            _fsync_path(path)
            files[rel] = {"sha256": sha256(path), "size": os.path.getsize(path)}
        manifest = {"format": FORMAT, "step": step, "optimizer_shards": ranks, "optimizer_tp": tp_group.size,
                    **({"optimizer_ep": ep_group.size} if ep_group.size > 1 else {}), "files": files}
        atomic_write(os.path.join(tmp, MANIFEST), [(json.dumps(manifest, indent=2) + "\n").encode("utf-8")])
        _fsync_path(tmp)
        if os.path.exists(final):  # a step-* that `latest` does not name (e.g. left by a crash)
            _remove_dir(directory, name)
        os.replace(tmp, final)
        _fsync_path(directory)
        atomic_write(os.path.join(directory, LATEST), [(name + "\n").encode("utf-8")])
        _fsync_path(directory)
        if keep_last is not None:
            dirs = _step_dirs(directory)
            keep = {n for _, n in dirs[-keep_last:]} | {name}
            for _, other in dirs:
                if other not in keep:
                    _remove_dir(directory, other)

    try:
        _together(groups, write)
        _together(groups, publish if leader else lambda: None)  # the others wait for `latest`
    except BaseException:
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify_checkpoint(step_dir: str | os.PathLike) -> dict:
    """Check every file against manifest.json; returns the manifest or raises CheckpointError."""
    step_dir = os.fspath(step_dir)
    manifest_path = os.path.join(step_dir, MANIFEST)
    if not os.path.isdir(step_dir):
        raise CheckpointError(f"{step_dir}: no such checkpoint directory")
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (partial checkpoint)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{manifest_path}: corrupt: {' '.join(str(error).split())}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (manifest.get("format") != FORMAT if isinstance(manifest, dict) else True) or not isinstance(files, dict) \
            or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
    for field in ("optimizer_shards", "optimizer_tp", "optimizer_ep"):
        count = manifest.get(field, 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise CheckpointError(f"{manifest_path}: {field} must be a positive integer, got {count!r}")
    shards = optimizer_files(manifest.get("optimizer_shards", 1), manifest.get("optimizer_tp", 1),
                             manifest.get("optimizer_ep", 1))
    for required in ("config.json", "model.safetensors", *shards, TRAINER_STATE_FILE):
        if required not in files:
            raise CheckpointError(f"{manifest_path}: does not list {required}")
    problem = files_problem(step_dir, files)
    if problem:
        raise CheckpointError(problem)
    return manifest


def read_trainer_state(step_dir: str | os.PathLike) -> dict:
    """A step directory's trainer state alone (the next step, the settings), without the weights."""
    state_path = os.path.join(os.fspath(step_dir), TRAINER_STATE_FILE)
    try:
        with open(state_path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{state_path}: unreadable: {' '.join(str(error).split())}") from None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a step directory, or the one `latest` names in a checkpoint directory; every file
    is verified against the manifest first, so the result is complete or an error is raised."""
    from rlportable.model.load import load_model

    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)) or _STEP_RE.match(os.path.basename(os.path.normpath(path))):
        step_dir = path
    else:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        step_dir = latest_checkpoint(path)
        if step_dir is None:
            raise CheckpointError(f"{path}: no checkpoint (no {LATEST} file and no step-* directory)")
    manifest = verify_checkpoint(step_dir)
    trainer_state = read_trainer_state(step_dir)
    try:
        config, weights, tokenizer = load_model(step_dir)
    except RlpError as error:
        raise CheckpointError(f"{step_dir}: model does not load: {error}") from None
    optimizer_state = OptimizerShards(step_dir, manifest.get("optimizer_shards", 1), manifest.get("optimizer_tp", 1),
                                      config, manifest.get("optimizer_ep", 1))
    return Checkpoint(step=manifest["step"], config=config, weights=weights, tokenizer=tokenizer,
                      optimizer_state=optimizer_state, trainer_state=trainer_state, path=step_dir)
