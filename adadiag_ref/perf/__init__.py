"""Performance tooling: the in-place benchmark engine, the ``bench`` and ``memory`` CLI subcommands."""
