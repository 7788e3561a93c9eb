"""``python -m llmdd`` / the ``llmdd`` command."""

from llmdd._tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
