"""The command-line tools: cli, doctor, bench and demo (they use the public API and the engine's statistics)."""
