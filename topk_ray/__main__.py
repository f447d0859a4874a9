"""``python -m topk_ray``: see :mod:`topk_ray.cli`."""

import sys

from topk_ray.cli import main

sys.exit(main())
