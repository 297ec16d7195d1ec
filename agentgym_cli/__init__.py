"""The ``agentgym`` command line. It lives outside ``agentgym/`` because it runs the Prefect
flows; the library (``agentgym``, ``env_adapters``) imports no Prefect."""
