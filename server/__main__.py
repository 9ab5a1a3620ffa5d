"""`python -m server ...`: the same as the `pagedserve` console script."""

from server.cli import main

main()
