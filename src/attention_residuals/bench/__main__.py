"""``python -m attention_residuals.bench``: the same as ``attnres bench``."""

import sys

from . import main

sys.exit(main())
