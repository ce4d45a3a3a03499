"""Everything that touches the model. `Engine` (engine.py) is the one façade for the TUI, CLI and bench."""
