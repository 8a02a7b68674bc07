"""The engine: what drives a model.

Configuration, requests and sampling, the scheduler and the paged KV cache,
input preparation, backend selection, the CUDA-graph runners and the executor
that runs one step. It sits above ``backplane.core``, the models, the backends
and the plugins, and below the Python API and the CLI.
"""
