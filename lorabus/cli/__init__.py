"""The ``lorabus`` command line, split by audience.

``main`` (the group, ``--version``, ``--log-level``), ``serve`` (the agent
and coordinator processes), ``orchestrate`` (update, status, schema),
``audit`` (tap, audit verify), ``demo`` and ``measure`` (the development
tools: up, sim, bench, chaos); ``common`` and ``extras`` hold what they
share, and :mod:`lorabus.service_flags` the serving processes' flags.
"""
