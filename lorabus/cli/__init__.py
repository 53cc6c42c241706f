"""The ``lorabus`` command line, split by audience.

``main`` (the group, ``--version``, ``--log-level``), ``serve`` (the agent
and coordinator processes), ``orchestrate`` (update, status, schema),
``audit`` (tap, audit verify), ``demo`` and ``measure`` (the development
tools: up, sim, bench, chaos); ``common``, ``flags`` and ``extras`` hold what
they share.
"""
