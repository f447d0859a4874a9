"""``python -m teacher_server`` = ``teacher-server``."""

import sys

from teacher_server.entry import main

sys.exit(main())
