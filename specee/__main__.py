"""`python -m specee ...` runs the same CLI as the `specee` console script."""
import sys

from .cli import main

sys.exit(main())
