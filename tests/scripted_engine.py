"""The engine interface's bookkeeping for scripted test engines (no model, no cache to drop)."""


class NoCacheEngine:
    """Subclass and define ``generate``; release, weight updates and close do nothing here."""

    generated_tokens = 0
    generate_seconds = 0.0
    syncs_adapters = False

    def release(self, keys):
        list(keys)

    def update_weights(self, named):
        pass

    def close(self):
        pass
