"""`python -m normexp` is the `normexp` command."""

from normexp.cli import main

main()
