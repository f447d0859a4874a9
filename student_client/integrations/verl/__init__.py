"""verl: running topk-distill teachers for verl's on-policy distillation, by URL
(docs/frameworks.md).

:mod:`.plugin` is the ``verl.plugins`` entry point (importing it installs it);
:mod:`.served_teachers` builds the teacher clients in place of verl's replicas;
:mod:`.teacher_client` is the client verl calls. Needs verl (``topk-distill[verl]``);
nothing here is imported until asked for.
"""
