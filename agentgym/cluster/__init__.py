"""Running the trainer ranks and rollout workers across processes and machines (Ray actors), and
moving weights between them (``weight_channel``: plain torch, no Ray). Importing this package
imports nothing of its own; import the modules."""
