"""`python -m moe2cta ...`: the `moe2cta` command (moe2cta.cli)."""
import sys

from moe2cta.cli import main

sys.exit(main())
