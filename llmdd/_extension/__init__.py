"""The extension plane: the pluggy plugin manager, the hook facade and the built-in hook implementations."""
