"""`python -m normexp.studies`: the command `normexp studies` (normexp/commands/tools.py), entered as
`python -m normexp` enters it (normexp/__main__.py), so that both have one command line, one signal
handling and one exit path. The one import in the package that runs back up its layers
(tests/test_layers.py allows this one alone)."""

import sys

from normexp.__main__ import main

if __name__ == "__main__":
    main(["studies", *sys.argv[1:]], prog_name="python -m normexp")
