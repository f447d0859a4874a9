"""``python -m teacher_server`` = ``teacher-server``."""

import sys

from teacher_server.cli import main

sys.exit(main())
