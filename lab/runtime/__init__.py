"""The runtime: plans, admission, the fenced store, the worker, the credit tool, their processes."""
