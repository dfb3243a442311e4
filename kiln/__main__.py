"""`python -m kiln` is the `kiln` command."""

from kiln.cli.app import main

main()
