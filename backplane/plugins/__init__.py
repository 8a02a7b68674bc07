"""In-tree plugins: thin modules of ``@hookimpl`` functions that describe backends.

They are discovered through the ``backplane.plugins`` entry points like any
third-party plugin, and import no kernel library at import time.
"""
