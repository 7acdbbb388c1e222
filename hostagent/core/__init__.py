"""Pure, no I/O: the model, the state machine, the configuration and small kits."""
