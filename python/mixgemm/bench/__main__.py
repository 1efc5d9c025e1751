"""``python -m mixgemm.bench``: the same options as ``mixgemm bench``."""
import sys

from .command import main

sys.exit(main())
