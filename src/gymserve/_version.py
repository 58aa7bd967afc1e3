"""The version of gymserve, stated once: ``pyproject.toml`` reads it at build time
(``[tool.setuptools.dynamic]``), ``gymserve.__version__`` re-exports it, and the server's OpenAPI
document and ``gymserve --version`` report it. Kept in a module of its own, importing nothing, so that
every layer may read it without importing the package's public face. PEP 440 form.
"""

__version__ = "0.1.0"
