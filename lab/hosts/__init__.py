"""Lab hosts: network namespaces joined by a bridge, faults between them, replicated PostgreSQL."""
