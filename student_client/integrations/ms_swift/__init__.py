"""ms-swift's distillation (GKD, GRPO's OPD-RL) on running topk-distill teachers: an
``--external_plugins`` file (``plugin.PLUGIN_FILE``) that makes
``--teacher_model_server topk-distill://host:port`` a gRPC teacher client (docs/frameworks.md).
"""
