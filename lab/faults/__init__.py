"""Faults: chaos, the network proxy, the crash-point matrix, and the invariant checker."""
