"""The ``real_vllm`` tier, a package so that its ``conftest`` is imported as
``real_vllm.conftest``: a second top-level ``conftest`` module would replace
the one that ``tests/real_dynamo``'s tests import names from when both tiers
are collected in one run."""
