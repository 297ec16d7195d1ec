"""bench/record_all.sh: the re-run of every CPU benchmark without a committed record. Its list
mode names each command; every command must name a script that exists and flags it parses, or
the unattended re-run would fail hours in."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _list(*args: str) -> list[str]:
    done = subprocess.run(["bash", "bench/record_all.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_every_command_names_a_script_and_flags_it_defines(tmp_path):
    lines = [ln for ln in _list("no-such-tag-xyz", "--list") if ln.startswith("to do ")]
    assert len(lines) >= 10
    helps: dict[str, str] = {}
    for ln in lines:
        record, cmd = re.match(r"to do (\S+)  <- \S+ (.+)$", ln).groups()
        script, *args = cmd.split()
        assert (ROOT / script).is_file(), ln
        if script not in helps:
            helps[script] = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                                           text=True, timeout=300).stdout
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"{flag}\b", helps[script]), f"{script} parses no {flag} (record_all.sh: {ln})"
        # the record it waits for is the one the script writes: <bench>-<the tag it passes>
        tag = args[args.index("--tag") + 1]
        assert record == f"bench/results/{Path(script).stem}-{tag}.json"


def test_only_and_existing_records(tmp_path):
    only = [ln for ln in _list("no-such-tag-xyz", "--only", "roofline", "--list")]
    assert only == ["to do bench/results/roofline-no-such-tag-xyz-1t.json  <- .venv/bin/python bench/roofline.py "
                    "--threads 1 --tag no-such-tag-xyz-1t"]
    # a record that exists is skipped (the re-run resumes): roofline's committed idle-2t-zero0
    assert _list("idle-2t-zero0", "--only", "roofline:1t", "--list") == [
        "to do bench/results/roofline-idle-2t-zero0-1t.json  <- .venv/bin/python bench/roofline.py --threads 1 "
        "--tag idle-2t-zero0-1t"]
    bad = subprocess.run(["bash", "bench/record_all.sh", "t", "--nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr
