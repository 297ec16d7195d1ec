"""Fill the Prefect variables that deployments/prefect.yaml uses as ``config`` parameters.

Every ``{{ prefect.variables.agentgym_config_<name> }}`` placeholder in the deployments'
parameters is set to the mapping of ``<config dir>/<name>.yaml`` (default ``configs/``, or
``$AGENTGYM_CONFIG_DIR``), after validating it with ``agentgym.config.load_config`` -- a bad
config fails here, with the field and the fix, instead of at run time. The variable holds the
file's own mapping (not the expanded config), so the deployment shows what the file says and the
rest keeps its defaults. ``prefect deploy`` then resolves the placeholders into the deployments.

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


def config_value(path: Path) -> dict[str, Any]:
    from agentgym.config import load_config

    load_config(path)  # validate (raises ConfigError naming the field and the fix)
    data = yaml.safe_load(path.read_text()) or {}
    data = json.loads(json.dumps(data))  # JSON types only (YAML dates etc. would not survive)
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
    missing = [f"{args.config_dir / (stem + '.yaml')}" for stem in wanted.values()
               if not (args.config_dir / f"{stem}.yaml").is_file()]
    if missing:
        print("missing config files: " + ", ".join(missing), file=sys.stderr)
        return 2
    for name, stem in sorted(wanted.items()):
        path = args.config_dir / f"{stem}.yaml"
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
