"""Old path of the module named below (kept, with a warning, until the next release)."""

from student_client._moved import forward

__getattr__ = forward(__name__, "student_client.data.alignment")
