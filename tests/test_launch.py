"""rlportable/launch.py: how a command's ranks start and stop, without GPUs (fake processes, a fake
launcher environment)."""

from __future__ import annotations

import pytest

from rlportable import launch


class FakeProcess:
    """A rank that exits with `code` after `polls` polls, or runs until terminated (code None)."""

    def __init__(self, code, polls):
        self.code, self.polls, self.returncode, self.terminated = code, polls, None, False

    def poll(self):
        if self.returncode is None and self.code is not None:
            self.polls -= 1
            if self.polls <= 0:
                self.returncode = self.code
        return self.returncode

    def terminate(self):
        self.terminated = True
        self.returncode = -15


def _spawn(monkeypatch, ranks):
    made = iter(ranks)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *args, **kwargs: next(made))
    return launch.spawn_ranks(len(ranks), ["info"], poll_s=0)


def test_a_failed_rank_stops_the_others_and_its_code_is_the_commands(monkeypatch):
    waiting, failing, done = FakeProcess(None, 0), FakeProcess(3, 2), FakeProcess(0, 1)
    assert _spawn(monkeypatch, [waiting, failing, done]) == 3
    assert waiting.terminated and not done.terminated  # rank 0 would wait for rank 1 forever


def test_ranks_that_all_finish_give_zero(monkeypatch):
    ranks = [FakeProcess(0, 3), FakeProcess(0, 1)]
    assert _spawn(monkeypatch, ranks) == 0
    assert not any(rank.terminated for rank in ranks)


@pytest.mark.parametrize("tp, dp, expected", [(1, 1, (1, 4)), (2, 1, (2, 2)), (2, 2, (2, 2)), (4, 1, (4, 1))])
def test_a_launchers_ranks_beyond_the_model_cut_are_replicas(monkeypatch, tp, dp, expected):
    """Under torchrun (WORLD_SIZE=4) --dp may be left out whatever --tp is: dp = WORLD_SIZE / tp."""
    seen = {}

    def run_ranks(device, world_size, emulate, work, kernel_source="native"):
        seen["world_size"] = world_size
        return True, None

    monkeypatch.setattr(launch, "world_from_env", lambda: type("World", (), {"size": 4})())
    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    launch.run_layout("cpu", tp, dp, False, lambda backend, tp_group, dp_group, ep_group: None)
    assert seen["world_size"] == expected[0] * expected[1]
