"""``python -m mixgemm``: the same command line as the ``mixgemm`` script."""
import sys

from .cli.main import main

sys.exit(main())
