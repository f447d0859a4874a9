"""The losses' tests share helpers kept in this folder (``losses_oracle``,
``coarse_oracle``, ``support_cases``, ``calls``): pytest puts this folder on ``sys.path``
for the conftest, so the tests in ``kernels/`` and ``divergences/`` import them by name
too."""
