"""The launcher's pure parts: how cores are shared out, the router's command line, the CLI's
checks (the processes themselves are tested for real in tests/replicas/)."""

from __future__ import annotations

import pytest

from pagedserve.server import cli, replicas
from pagedserve.server.replicas import router_command, split_cores


def test_cores_are_split_into_equal_disjoint_contiguous_shares():
    assert split_cores([0, 1], 2) == [(0,), (1,)]
    assert split_cores([3, 1, 2, 0], 2) == [(0, 1), (2, 3)]
    assert split_cores([0, 1], 1) == [(0, 1)]


def test_leftover_cores_go_to_the_first_replicas():
    assert split_cores(range(5), 2) == [(0, 1, 2), (3, 4)]


def test_more_replicas_than_cores_share_them_round_robin():
    assert split_cores([0, 1], 3) == [(0,), (1,), (0,)]


def test_zero_replicas_is_an_error():
    with pytest.raises(ValueError, match=">= 1"):
        split_cores([0, 1], 0)


def test_the_router_gets_every_worker_and_no_circuit_breaker():
    command = router_command(["http://a:1", "http://b:2"], "0.0.0.0", 8000, "round_robin")
    start = command.index("--worker-urls") + 1
    assert command[start : start + 2] == ["http://a:1", "http://b:2"]
    assert command[command.index("--policy") + 1] == "round_robin"
    assert "--disable-circuit-breaker" in command  # 0.3.2 counts a worker's 4xx as failures


def test_replica_flags_are_checked_once_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["replicas", "-n", "2", "--block-size", "0"])
    assert exit_info.value.code == 2
    assert "cache.block_size" in capsys.readouterr().err


def test_an_unknown_flag_is_refused_for_replicas_and_for_serve(capsys):
    for argv in (["replicas", "--no-such-flag"], ["serve", "--no-such-flag"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        assert "--no-such-flag" in capsys.readouterr().err


def test_the_number_of_replicas_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["replicas", "-n", "0"])
    assert "--num-replicas must be >= 1" in capsys.readouterr().err


def test_a_port_is_never_handed_out_twice(monkeypatch):
    # The OS may offer a port again until a child binds it: the launcher must not pass it on.
    offered = iter([5001, 5001, 5002, 5003, 5002, 5004])

    class OfferingSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(replicas.socket, "socket", OfferingSocket)
    monkeypatch.setattr(replicas, "_handed_out", {5003})  # the router's public port
    assert [replicas.free_port() for _ in range(3)] == [5001, 5002, 5004]
