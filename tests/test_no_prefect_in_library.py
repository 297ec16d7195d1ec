"""`agentgym` and `env_adapters` are a library: every one of their modules imports with Prefect
made unimportable (only `flows/`, `tasks/` and the command line, `agentgym_cli/`, use it)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# needs the separate vLLM environment (.venv-vllm); it imports no Prefect either (grep-checked below)
NEEDS_OTHER_ENV = {"agentgym.rollout.engines.vllm"}

PROBE = """
import importlib, sys

class NoPrefect:
    def find_spec(self, name, path=None, target=None):
        if name == "prefect" or name.startswith("prefect."):
            raise ImportError(f"the library imported {name}")
        return None

sys.meta_path.insert(0, NoPrefect())
for name in sys.argv[1:]:
    importlib.import_module(name)
assert not any(m == "prefect" or m.startswith("prefect.") for m in sys.modules)
print("imported", len(sys.argv) - 1)
"""


def _modules() -> list[str]:
    names = []
    for pkg in ("agentgym", "env_adapters"):
        names.append(pkg)
        for info in pkgutil.walk_packages([str(ROOT / pkg)], prefix=f"{pkg}."):
            names.append(info.name)
    return [n for n in names if n not in NEEDS_OTHER_ENV]


def test_library_imports_without_prefect():
    mods = _modules()
    assert "agentgym.pipeline" in mods and "env_adapters.checker" in mods  # the walk found them
    out = subprocess.run([sys.executable, "-c", PROBE, *mods], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"imported {len(mods)}" in out.stdout


def test_the_vllm_engine_source_names_no_prefect():
    assert "prefect" not in (ROOT / "agentgym/rollout/engines/vllm.py").read_text()


def test_the_probe_catches_prefect():
    out = subprocess.run([sys.executable, "-c", PROBE, "flows.train"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0 and "the library imported prefect" in out.stderr
