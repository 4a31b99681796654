"""The command line (`sdpipe`, `python -m flows.cli`) and what only it runs: terminal progress,
`sdpipe status`, the data root's local Prefect server and worker, and the loopback servers.
"""

from flows.cli.commands import main

__all__ = ["main"]
