"""The coordinator: the public Generate service and the round loop."""
