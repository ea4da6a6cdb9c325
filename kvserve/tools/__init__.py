"""The capacity and diagnosis commands: kvserve estimate, advise and doctor (no torch on these paths)."""
