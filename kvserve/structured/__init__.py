"""Structured output: constraints (JSON schema, regex, choice, grammar), grammar backends, per-request matchers.

Imports downward only (torch and the grammar libraries); the engine and the server plug these pieces in. The
package itself imports nothing, so that its light modules (config, params) cost what they are: `kvserve
estimate` reads EngineConfig, which holds a StructuredOutputsConfig, and must not import torch. The grammar
libraries are imported when a backend is built.
"""
