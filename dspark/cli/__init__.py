"""The `dspark` command (`python -m dspark.cli <subcommand>`); subcommands live in `commands`."""
from dspark.cli.commands import main

__all__ = ["main"]
