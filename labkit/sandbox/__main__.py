"""`python -m labkit.sandbox`: the sandbox's own command line."""

import sys

from labkit.sandbox import main

sys.exit(main())
