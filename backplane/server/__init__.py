"""The OpenAI-compatible HTTP server (``backplane serve``): FastAPI + uvicorn over :class:`AsyncLLM`.

Modules: ``protocol`` (request bodies and their sampling parameters), ``app``
(the routes, errors, streaming), ``metrics`` (Prometheus), ``run`` (uvicorn).
Needs the ``serve`` extra (``pip install 'backplane[serve]'``).
"""
