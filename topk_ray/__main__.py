"""``python -m topk_ray``: see :mod:`topk_ray.ray_cli`."""

import sys

from topk_ray.ray_cli import main

sys.exit(main())
