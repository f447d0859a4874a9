"""``python -m teacher_server`` = ``teacher-server``."""

from teacher_server.cli import main

main()
