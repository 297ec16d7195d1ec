"""Fill the Prefect variables that deployments/prefect.yaml uses as ``config`` parameters.

Every ``{{ prefect.variables.agentgym_config_<name> }}`` placeholder in the deployments'
parameters is set to the mapping of ``<config dir>/<name>.yaml`` (default ``configs/``, or
``$AGENTGYM_CONFIG_DIR``; a ``-`` in a file name is ``_`` in its variable's: ``tiny-keyword.yaml``
is ``agentgym_config_tiny_keyword``), after validating it with ``agentgym.config.load_config`` --
a bad config fails here, with the field and the fix, instead of at run time. The variable holds
the file's own mapping (not the expanded config), so the deployment shows what the file says and
the rest keeps its defaults; only its task-id lists are written as one string each (``"0:40, 80"``,
``agentgym.config.compact_task_ids``: the same ids, in the same order), which the Prefect run form
shows as one text field instead of a box per id. ``prefect deploy`` then resolves the
placeholders into the deployments.

    python deployments/sync_variables.py [--prefect-file deployments/prefect.yaml] [--config-dir configs]

Needs ``PREFECT_API_URL`` (``deployments/local.sh deploy`` runs it with the local server's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\{\{\s*prefect\.variables\.(agentgym_config_([a-z0-9_]+))\s*\}\}")
MAX_CHARS = 5000  # Prefect's limit on a variable's JSON value


def placeholders(prefect_file: Path) -> dict[str, str]:
    """``{variable name: config stem}`` for every config placeholder in the deployments."""
    spec = yaml.safe_load(prefect_file.read_text())
    found: dict[str, str] = {}

    def walk(node: Any) -> None:
        if isinstance(node, str):
            for m in PLACEHOLDER.finditer(node):
                found[m.group(1)] = m.group(2)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for dep in spec.get("deployments") or []:
        walk(dep.get("parameters") or {})
    return found


def config_file(config_dir: Path, stem: str) -> Path:
    """The config file of a placeholder's name: ``<stem>.yaml``, else with ``-`` for ``_``."""
    path = config_dir / f"{stem}.yaml"
    dashed = config_dir / f"{stem.replace('_', '-')}.yaml"
    return dashed if not path.is_file() and dashed.is_file() else path


def config_value(path: Path) -> dict[str, Any]:
    from agentgym.config import compact_task_ids, load_config

    load_config(path)  # validate (raises ConfigError naming the field and the fix)
    data = yaml.safe_load(path.read_text()) or {}
    data = json.loads(json.dumps(data))  # JSON types only (YAML dates etc. would not survive)
    for env in data.get("envs") or []:  # one text field each in the run form
        for key in ("tasks", "eval_tasks"):
            if isinstance(env, dict) and isinstance(env.get(key), list):
                env[key] = compact_task_ids(env[key])
    size = len(json.dumps(data))
    if size >= MAX_CHARS:
        raise SystemExit(f"{path}: {size} characters of JSON; a Prefect variable holds < {MAX_CHARS}. "
                         "Shorten the config (e.g. task ranges) or pass it with --param config=...")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefect-file", type=Path, default=ROOT / "deployments" / "prefect.yaml")
    ap.add_argument("--config-dir", type=Path,
                    default=Path(os.environ.get("AGENTGYM_CONFIG_DIR", ROOT / "configs")))
    args = ap.parse_args(argv)
    from prefect.variables import Variable

    from agentgym.config import ConfigError

    wanted = placeholders(args.prefect_file)
    missing = [str(config_file(args.config_dir, stem)) for stem in wanted.values()
               if not config_file(args.config_dir, stem).is_file()]
    if missing:
        print("missing config files: " + ", ".join(missing), file=sys.stderr)
        return 2
    for name, stem in sorted(wanted.items()):
        path = config_file(args.config_dir, stem)
        try:
            value = config_value(path)
        except ConfigError as e:
            print(str(e), file=sys.stderr)
            return 2
        Variable.set(name, value, overwrite=True)
        print(f"variable {name} <- {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
