"""pytest plugin of llmdd (loaded through the ``pytest11`` entry point): fixtures."""
