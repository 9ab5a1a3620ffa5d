"""`python -m pagedserve.server ...`: the same as the `pagedserve` console script."""

from pagedserve.server.cli import main

main()
