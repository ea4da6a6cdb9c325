"""The server tests' fixtures live in server_support.py; a uniquely named module, since several test
folders have a conftest.py and `from conftest import ...` would pick whichever came first."""

from server_support import http, make_server, server, tiny_model_dir  # noqa: F401
