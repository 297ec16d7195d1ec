"""Does a killed and resumed ablation run end where the uninterrupted run ends?

Three short runs of the TextCraft warm-start ablation's config (SmolLM2 from the warm start of
``ablation.py warmstart --env textcraft-warm``; 4 iterations at horizon 5, a checkpoint every 2,
no held-out evaluation), each in its own MLflow DB and trajectory store under ``--workdir``:

- ``straight``: uninterrupted;
- ``exact``: SIGKILLed once its step-2 checkpoint is committed, then resumed with the same
  command (``tracking.checkpoint_trainer_state: true``, the config's setting);
- ``weights-only``: the same kill and resume with ``checkpoint_trainer_state: false`` (a resume
  restores the weights and restarts AdamW).

It prints each run's final weights' SHA-256 and the largest absolute weight difference from the
straight run, and writes them with each run's minutes to ``bench/results/resume_check-<tag>.json``
(``results_io``). About 10 minutes on the 2-core machine (bench/README.md, section 10); run it alone.

    .venv/bin/python bench/learning/resume_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ablation.py, run_records.py

from ablation import ROOT, config_path, warm_start_folder  # noqa: E402
import results_io  # noqa: E402  (bench/, which ablation puts on sys.path)
from run_records import weights_fingerprint  # noqa: E402

ITERATIONS, EVERY, KILL_AFTER = 4, 2, 2


def command(workdir: Path, name: str, warm: Path, keep_state: bool) -> list[str]:
    sets = [f"tracking.tracking_uri=sqlite:///{workdir / name}.db", "tracking.experiment=resume-check",
            f"store.root={workdir / name}-trajectories", f"model.name_or_path={warm}", "sft.enabled=false",
            "heldout.enabled=false", "tracking.log_model=false", "seed=0",
            f"tracking.checkpoint_every={EVERY}", f"tracking.checkpoint_trainer_state={str(keep_state).lower()}",
            "schedule.stages=" + json.dumps([{"horizon": 5, "iterations": ITERATIONS}])]
    cmd = [str(Path(sys.executable).parent / "agentgym"), "train", "-c", str(config_path("textcraft-warm")),
           "--run-id", name]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def committed_step(db: Path) -> int:
    """The newest committed checkpoint step of any stage run in ``db`` (0: none yet)."""
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        try:
            rows = con.execute("select value from tags where key = 'agentgym.last_checkpoint_step'").fetchall()
        except sqlite3.OperationalError:  # the schema is not there yet
            return 0
    return max((int(v) for (v,) in rows), default=0)


def run(workdir: Path, name: str, warm: Path, keep_state: bool, kill: bool) -> float:
    """Run ``name`` (killed once after its step-``KILL_AFTER`` checkpoint and resumed if ``kill``);
    returns the seconds it took."""
    cmd, log = command(workdir, name, warm, keep_state), open(workdir / f"{name}.log", "ab")
    t0 = time.perf_counter()
    if kill:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while committed_step(workdir / f"{name}.db") < KILL_AFTER:
            if p.poll() is not None:
                raise SystemExit(f"{name} ended (exit {p.returncode}) before its step-{KILL_AFTER} checkpoint: "
                                 f"see {workdir / name}.log")
            time.sleep(0.5)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        print(f"{name}: killed after its step-{KILL_AFTER} checkpoint ({time.perf_counter() - t0:.0f} s)", flush=True)
    code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{name} failed (exit {code}): see {workdir / name}.log")
    return time.perf_counter() - t0


def final_weights(workdir: Path, name: str) -> Path:
    from agentgym.registry.champion import materialize
    from agentgym.tracking.tracker import Tracker

    tracker = Tracker(f"sqlite:///{workdir / name}.db", "resume-check")
    ref = tracker.latest_checkpoint(name)
    assert ref is not None and ref.global_step == ITERATIONS, ref
    return materialize(ref.artifact_uri, tracker.uri)


def max_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "resume-check")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/resume_check-<tag>.json "
                    "(default: the UTC time)")
    args = ap.parse_args()
    record = results_io.Run("resume_check", args)
    warm = warm_start_folder("textcraft-warm")
    if warm is None:
        print("no finished warm start: run first\n  .venv/bin/python bench/learning/ablation.py warmstart "
              "--env textcraft-warm", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=False)
    arms = {"straight": (True, False), "exact": (True, True), "weights-only": (False, True)}
    seconds = {name: run(args.workdir, name, warm, keep, kill) for name, (keep, kill) in arms.items()}
    folders = {name: final_weights(args.workdir, name) for name in arms}
    print(f"\nwarm start {weights_fingerprint(warm)}; {ITERATIONS} iterations at horizon 5, "
          f"killed after the step-{KILL_AFTER} checkpoint and resumed\n")
    print("| run | trainer state | minutes | final weights | max abs diff from straight |\n|---|---|---:|---|---:|")
    repeats = []
    for name, (keep, kill) in arms.items():
        diff = max_difference(folders[name], folders["straight"])
        sha = weights_fingerprint(folders[name])
        repeats.append({"run": name, "trainer_state": keep, "killed": kill, "seconds": seconds[name],
                        "final_weights": sha, "max_abs_diff_from_straight": diff})
        print(f"| {name} | {'kept' if keep else 'not kept'} | {seconds[name] / 60:.1f} | {sha[:19]}… | {diff:.3g} |")
    path = record.write(repeats, {"warm_start": weights_fingerprint(warm), "iterations": ITERATIONS,
                                  "kill_after_step": KILL_AFTER})
    print(f"\nrecord: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
