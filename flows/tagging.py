"""Tags on flow runs, none on their task runs.

A pipeline run's subflow runs carry its Prefect tags (``run:<id>``, ``stage:<i>``, ...), which
is where the UI and the API filter runs. Their task runs would inherit them from the tags
context, and Prefect's task engine checks every tagged task run against the server's tag
concurrency limits: a server round trip per task run whenever its 5-second cache of "no limit
for these tags" has expired, i.e. at every task of an iteration longer than that; with SmolLM2
those waits were most of the pipeline's overhead (measured in bench/README.md, section 3). So
the subflows run their bodies with the tags context emptied: the subflow run keeps its tags,
its task runs have none (find them through their flow run).
"""

from __future__ import annotations

from prefect.context import TagsContext


def untagged_tasks() -> TagsContext:
    """A context (``with untagged_tasks():``, as a flow's body) in which task runs start with no
    tags; the flow run itself was tagged when it was created."""
    return TagsContext(current_tags=set())
