"""Which Prefect UI the MLflow runs link (tasks/links.py): a configured server's, never a temporary
one's. The flows' MLflow tags are checked end to end in test_train_flow.py (temporary server: no
URL) and test_deployments.py (a configured server: its flow-run pages)."""

import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

from tasks.links import TEMPORARY_SERVER_ENV, prefect_ui_url


@pytest.mark.parametrize("api, ui, temporary, want", [
    (None, None, None, None),  # Prefect's own ephemeral server
    ("http://127.0.0.1:4200/api", None, None, "http://127.0.0.1:4200"),  # e.g. deployments/local.sh
    ("http://127.0.0.1:4200/api", "https://prefect.example.org/", None, "https://prefect.example.org"),
    ("http://127.0.0.1:8123/api", None, "http://127.0.0.1:8123/api", None),  # agentgym's temporary server
    ("http://127.0.0.1:4200/api", None, "http://127.0.0.1:8123/api", "http://127.0.0.1:4200"),
])
def test_only_a_configured_server_is_linked(monkeypatch, api, ui, temporary, want):
    if temporary:
        monkeypatch.setenv(TEMPORARY_SERVER_ENV, temporary)
    else:
        monkeypatch.delenv(TEMPORARY_SERVER_ENV, raising=False)
    with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_UI_URL: ui}):
        assert prefect_ui_url() == want
