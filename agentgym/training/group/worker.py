"""One rank of the resident training group: ``python -m agentgym.training.group.worker``, started by the
launcher (``group_launcher.launcher_cmd``). It connects to the driver, builds a ``PolicyTrainer``
on ``init`` and then serves commands by name from ``RankServer.ops`` until ``exit`` or until the
driver's end closes (a rank never outlives its driver).

Idle, a rank blocks on its connection, not in a collective, so long rollouts in the driver
cannot trip a collective timeout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from agentgym.config import AlgorithmConfig, TrainerConfig
from agentgym.training import policy_trainer as T
from agentgym.training.batch import TrainBatch
from agentgym.training.group.rpc import AUTHKEY_ENV, Client, Connection, plain, recv, send


class RankServer:
    """A rank's trainer and the commands the driver may send it. Every command reaches every
    rank (ZeRO-3 gathers and the update's all-reduces are collectives); replies are rank 0's
    where only one is wanted."""

    def __init__(self, conn: Connection, rank: int):
        self.conn, self.rank = conn, rank
        self.trainer: T.PolicyTrainer | None = None
        self.ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "init": self.init, "ping": lambda msg: {},
            "train": self.train, "train_from_store": self.train_from_store, "compute": self.compute,
            "weights": self.weights, "digest": self.digest,
            "save_hf": self.save_hf, "save_adapter": self.save_adapter, "save_checkpoint": self.save_checkpoint,
            "load_checkpoint": self.load_checkpoint, "sft_metrics": self.sft_metrics,
            "advance_lr_schedule": self.advance_lr_schedule,
        }

    def _trainer(self) -> T.PolicyTrainer:
        if self.trainer is None:
            raise RuntimeError(f"rank {self.rank} has no trainer yet: the driver sends 'init' first")
        return self.trainer

    # -- commands: msg -> result -----------------------------------------------------------
    def init(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.trainer = T.PolicyTrainer(
            msg["model_path"], SimpleNamespace(pad_token_id=msg["pad_id"]),
            TrainerConfig.model_validate(msg["trainer"]), AlgorithmConfig.model_validate(msg["algorithm"]),
            temperature=msg["temperature"], seed=msg["seed"],
        )
        return {}

    def train(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"metrics": self._trainer().train_on_batch(
            TrainBatch(**msg["batch"]), seed=msg["seed"], objective=msg.get("objective", "ppo"),
            epochs=msg.get("epochs"), mini_batches=msg.get("mini_batches"))}

    def train_from_store(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The batch comes from the trajectory store, not over the connection."""
        return {"metrics": self._trainer().train_from_store(msg["store"], msg["stage"], msg["iteration"],
                                                            seed=msg["seed"])}

    def compute(self, msg: dict[str, Any]) -> dict[str, Any]:
        got = self._trainer().compute(TrainBatch(**msg["batch"]), msg["what"])
        return {"tensors": got if self.rank == 0 else {}}

    def sft_metrics(self, msg: dict[str, Any]) -> dict[str, Any]:
        got = self._trainer().sft_metrics(TrainBatch(**msg["batch"]))
        return {"metrics": got if self.rank == 0 else {}}

    def advance_lr_schedule(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._trainer().advance_lr_schedule(msg["steps"])
        return {}

    def weights(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Every rank iterates (ZeRO-3 gathers); rank 0 streams each tensor before its reply."""
        for name, t in self._trainer().named_weights():
            if self.rank == 0:
                t = t.detach()
                if t.untyped_storage().nbytes() != t.nbytes or not t.is_contiguous():
                    t = t.contiguous().clone()  # a view would send its whole storage
                send(self.conn, {"kind": "tensor", "seq": msg["seq"], "name": name, "tensor": t})
        return {}

    def digest(self, msg: dict[str, Any]) -> dict[str, Any]:
        h = hashlib.sha256()
        for name, t in self._trainer().named_weights():
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return {"digest": h.hexdigest()}

    def save_hf(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._trainer().save_hf(msg["dir"], None)
        return {}

    def save_adapter(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._trainer().save_adapter(msg["dir"])
        return {}

    def save_checkpoint(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._trainer().save_checkpoint(msg["dir"], msg["client_state"])
        return {}

    def load_checkpoint(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"client_state": self._trainer().load_checkpoint(msg["dir"])}

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> int:
        while True:
            try:
                msg = recv(self.conn)
            except EOFError:  # the driver is gone: nothing left to serve
                print(f"rank {self.rank}: driver closed the channel, exiting", flush=True)
                return 0
            op, seq = msg["op"], msg["seq"]
            if op == "exit":
                return 0
            t0 = time.perf_counter()
            try:
                if op not in self.ops:
                    raise ValueError(f"unknown command {op!r}")
                result = self.ops[op](msg)
                if self.trainer is not None:
                    result["optimizer_steps_total"] = self.trainer.optimizer_steps
                reply = {"kind": "reply", "seq": seq, "ok": True, "result": plain(result),
                         "weight_loads": T.weight_loads(), "seconds": time.perf_counter() - t0}
            except Exception:  # noqa: BLE001 - reported to the driver, which takes the group down
                err = traceback.format_exc()
                print(err, flush=True)
                reply = {"kind": "reply", "seq": seq, "ok": False, "error": err}
            send(self.conn, reply)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one rank of agentgym's resident training group")
    ap.add_argument("--driver", required=True, help="host:port the driver listens on")
    ap.add_argument("--log-dir", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ["RANK"])
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"rank{rank}.log", "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(int(os.environ.get("AGENTGYM_THREADS", "1")))
    host, port = args.driver.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    send(conn, {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()})
    print(f"rank {rank} pid {os.getpid()} connected to {args.driver}", flush=True)
    return RankServer(conn, rank).serve()


if __name__ == "__main__":
    sys.exit(main())
