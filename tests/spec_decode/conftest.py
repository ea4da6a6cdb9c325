"""Speculative-decoding tests: tiny random checkpoints from tests/models and the server helpers of tests/server
(both folders put on sys.path, since pytest only adds this test's own folder; the server fixtures re-exported)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_support import make_server, tiny_model_dir  # noqa: F401 -- fixtures for test_spec_server.py
