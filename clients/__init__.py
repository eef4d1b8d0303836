"""Clients for the kimi_k25_vision ensemble: `kimi_client` (library), `infer` (CLI), `samples`."""
