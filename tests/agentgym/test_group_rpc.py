"""The resident group's channel without starting ranks: authkey handshake, the weights-only
payloads, and the acceptor that hands over ranks' connections while the driver keeps watch."""

from __future__ import annotations

import threading

import pytest
import torch

from agentgym.training.group.rpc import Client, RankAcceptor, plain, recv, send


def _connect(address, key, hello):
    conn = Client(address, authkey=key)
    send(conn, hello)
    return conn


def test_ranks_with_the_key_get_in_others_do_not():
    key = b"k" * 32
    acc = RankAcceptor("127.0.0.1", key, backlog=2)
    try:
        with pytest.raises(Exception, match="digest"):  # multiprocessing.AuthenticationError
            Client(acc.address, authkey=b"wrong" * 8)
        rank = _connect(acc.address, key, {"rank": 1, "pid": 42, "host": "h"})
        hello, conn = acc.get(timeout=10)
        assert hello == {"rank": 1, "pid": 42, "host": "h"}
        # both ways, tensors included; a reply must survive weights_only loading
        send(conn, {"op": "ping", "seq": 3, "t": torch.arange(4)})
        msg = recv(rank)
        assert msg["seq"] == 3 and torch.equal(msg["t"], torch.arange(4))
        rank.close()
        with pytest.raises(EOFError):  # a rank that died is an EOF on the driver's side
            recv(conn)
        assert acc.get(timeout=0.2) is None
    finally:
        acc.close()
    assert not any(t.name == "agentgym-group-accept" for t in threading.enumerate())  # close() ends it


def test_payloads_are_weights_only():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    key = b"x" * 32
    acc = RankAcceptor("127.0.0.1", key, backlog=1)
    try:
        rank = _connect(acc.address, key, {"rank": 0, "pid": 1, "host": "h"})
        _, conn = acc.get(timeout=10)
        send(rank, {"obj": Evil()})
        with pytest.raises(Exception, match="[Ww]eights only"):
            recv(conn)
    finally:
        acc.close()


def test_plain_makes_replies_loadable():
    import numpy as np

    assert plain({1: np.float32(0.5), "l": (np.int64(2), "s")}) == {"1": 0.5, "l": [2, "s"]}


def test_a_rank_serves_commands_from_its_table_and_exits_with_its_driver():
    """group_worker.RankServer over a pipe: a known command is answered, an unknown one comes
    back as an error reply (the driver then takes the group down), EOF ends the rank."""
    from multiprocessing import Pipe

    from agentgym.training.group.worker import RankServer

    driver, rank_end = Pipe()
    server = RankServer(rank_end, rank=0)
    assert {"init", "train", "train_from_store", "compute", "weights", "save_checkpoint"} <= set(server.ops)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("rc", server.serve()), daemon=True)
    t.start()
    send(driver, {"op": "ping", "seq": 1})
    reply = recv(driver)
    assert reply["ok"] and reply["seq"] == 1 and reply["result"] == {}
    send(driver, {"op": "no-such-command", "seq": 2})
    reply = recv(driver)
    assert not reply["ok"] and "unknown command 'no-such-command'" in reply["error"]
    driver.close()
    t.join(timeout=10)
    assert done == {"rc": 0}
