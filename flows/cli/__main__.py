"""`python -m flows.cli`: the same command line as the `sdpipe` script."""

import sys

from flows.cli.commands import main

sys.exit(main())
