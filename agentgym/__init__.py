"""AgentGym-RL core library. Imports no Prefect: flows/ and tasks/ wrap it, never the reverse.

The top-level modules are the contract and the math: ``config`` (typed settings), ``types`` (the
records that cross boundaries), ``algorithms`` (advantages and losses), ``chat`` (conversations as
token ids), ``context`` (context policies), ``schedule`` (ScalingInter-RL stages) and ``pipeline``
(one iteration's steps). The subpackages hold one job each: ``rollout`` (the multi-turn loop and
its inference engines), ``training`` (DeepSpeed updates, SFT, the resident rank group), ``store``
(Parquet trajectory tables), ``tracking`` (MLflow and Prefect records), ``registry`` (the model
registry), ``models`` (model folders and the packaged SmolLM2), ``evaluation`` (held-out success,
learning curves, run inspection), ``infra`` (disk, temp folders, heap, progress) and ``patches``
(every change made to a third-party library).
"""

import sys as _sys
from pathlib import Path as _Path

from agentgym._moved import MovedModuleFinder as _MovedModuleFinder

__version__ = "0.1.0"

#: the folder holding this package (and env_adapters/): what a child process started from here
#: (a vLLM server, a rank group) puts on its PYTHONPATH
PACKAGE_ROOT = _Path(__file__).resolve().parents[1]

if not any(isinstance(f, _MovedModuleFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedModuleFinder())
