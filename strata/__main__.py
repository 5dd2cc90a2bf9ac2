"""``python -m strata``: the ``strata`` command."""

import sys

from strata.entry import main

sys.exit(main())
