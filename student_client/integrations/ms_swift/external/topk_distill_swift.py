"""``swift rlhf ... --external_plugins <this file>``: installs topk-distill's ms-swift
plugin (:func:`student_client.integrations.ms_swift.plugin.install`), after which
``--teacher_model_server topk-distill://host:port`` names a running topk-distill teacher.
"""

from student_client.integrations.ms_swift.plugin import install

install()
