"""Support modules of the lab's own tests, imported as ``tests.support.<name>``.

``labtree`` (experiment trees that pass the gate), ``canned_model`` (signed model
evidence without a model), ``tiny_gguf`` (a tiny GGUF llama.cpp loads),
``workstore`` (a store and approved workflows for the worker tests),
``docker_standin`` (a Docker Engine API stand-in), ``scripts`` (a file of
``scripts/`` imported as a module) and ``keys`` (the ``make_key`` fixture plugin,
``KeyFiles`` and ``resign``). ``hold_postgres.py`` is run as a
process of its own: ``python tests/support/hold_postgres.py MODE``.
"""
