"""`python -m xsched.cli ...` (what torchrun runs: torchrun --nproc-per-node N -m xsched.cli train ...)."""

import sys

from xsched.cli import main

sys.exit(main())
