"""The ``fastdata`` command: subcommands, bench, timing, the demo and its synthetic data."""
