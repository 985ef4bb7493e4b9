"""specd's benchmarks and measurement tools (outside the installed specd package)."""
