"""Speculative decoding: the drafters (n-gram prompt lookup, suffix tries), verification and the adaptive gate.

Imports downward only (sampling_params, nothing of engine/): the engine hands its requests in through the
`DraftRequest` protocol and applies what `verify_greedy` accepts."""
