"""Compiled CPU kernels, built on first use with the system compiler, each with a plain-torch fallback."""
