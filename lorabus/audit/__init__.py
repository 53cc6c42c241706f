"""The audit trail and its pictures: reading and following it, checking it
against the promises, writing it to a file, and drawing it (text for a
terminal, the timeline page, the fleet as its heartbeats show it).
Internal: not part of the public API (see ``lorabus``)."""
