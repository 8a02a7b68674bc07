"""An example backplane plugin package.

``plugin`` is the module the ``backplane.plugins`` entry point names: it only
describes the backend. ``attention`` holds the backend itself and is imported
only when the engine (or a test) selects the ``example`` attention backend.
"""

__version__ = "0.1.0"
