"""Temporary folders of a process killed with SIGKILL (checkpoint exports, group folders) are
removed by the next process that makes one (``agentgym.infra.tempdirs``), and only those: a live
process's folder, a folder whose PID now runs another process, another host's and an old-style
folder without an owner are handled as the module says (kept, removed, kept, kept)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentgym.infra import tempdirs

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# a real checkpoint export into a scratch folder (what tasks/rl.py's save_checkpoint does),
# killed with SIGKILL halfway; or a process that holds its folders and waits
CHILD = """
import os, signal, shutil, sys, time
from pathlib import Path
from agentgym.infra import tempdirs
mode, model = sys.argv[1], sys.argv[2]
group = tempdirs.make("agentgym-group-")
(group / "logs-0").mkdir()
(group / "logs-0" / "rank0.log").write_text("a rank's log")
with tempdirs.scratch("agentgym-ckpt-") as ckpt:
    for f in Path(model).iterdir():
        shutil.copy2(f, ckpt)
    print(group, ckpt, flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # until the test closes our stdin
"""


def child(mode: str, model: str, tmp: Path) -> tuple[subprocess.Popen, list[Path]]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode, model], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    folders = [Path(f) for f in p.stdout.readline().split()]
    assert len(folders) == 2 and all(f.is_dir() for f in folders), folders
    return p, folders


def test_folders_of_a_sigkilled_process_are_removed_by_the_next_one(tmp_path, tiny_path, monkeypatch):
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # this process's TMPDIR, as the children's

    killed, dead = child("kill", tiny_path, tmp)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert all(f.is_dir() for f in dead) and (dead[1] / "model.safetensors").is_file()  # left behind
    live, alive = child("wait", tiny_path, tmp)

    me = os.getpid()
    reused = tmp / f"agentgym-ckpt-p{me}-1-{tempdirs.owner_tag().split('-')[2]}-reused"  # our PID, other start
    elsewhere = tmp / f"agentgym-ckpt-p{killed.pid}-1-00000000-otherhost"  # a PID of another namespace
    legacy = tmp / "agentgym-ckpt-abc123"  # made before owners were named: unknown
    unrelated = tmp / f"something-p{killed.pid}-1-{tempdirs.owner_tag().split('-')[2]}-x"
    for f in (reused, elsewhere, legacy, unrelated):
        f.mkdir()

    try:
        with tempdirs.scratch("agentgym-ckpt-") as mine:  # the next run's checkpoint export
            assert Path(mine).parent == tmp and Path(mine).name.startswith(f"agentgym-ckpt-p{me}-")
            left = {p.name for p in tmp.iterdir()}
            assert not any(f.exists() for f in dead), left  # the killed process's folders: removed
            assert not reused.exists(), left
            assert all(f.is_dir() for f in alive), left  # a live process's: kept
            assert elsewhere.is_dir() and legacy.is_dir() and unrelated.is_dir(), left
        assert not Path(mine).exists()
    finally:
        live.stdin.close()  # the live child finishes: its scratch folder goes with it
        assert live.wait(timeout=60) == 0
    # its group folder (never closed, as a SIGKILLed driver's) is removed by the next sweep
    assert alive[0].is_dir() and not alive[1].exists()
    assert tempdirs.sweep() == [alive[0]]
    assert sorted(p.name for p in tmp.iterdir()) == sorted(f.name for f in (elsewhere, legacy, unrelated))


def test_the_owner_is_in_the_name_not_in_the_folder(tmp_path):
    """A checkpoint export is uploaded whole: no marker file may end up in it."""
    with tempdirs.scratch("agentgym-ckpt-", tmp_path) as d:
        assert list(Path(d).iterdir()) == []
        assert tempdirs.sweep(tmp_path) == []  # ours, alive
