"""Peers: the tools a user would otherwise pick, run on the same weights in the same benchmark run."""
