"""`python -m moe2cta.serving_bench`: same as the `moe2cta-bench` console script."""
import sys

from .cli import main

sys.exit(main())
