"""The embeddings handed out by NIXL (docs/llm_handoff.md#pulling-the-embeddings-with-nixl): each encoder
instance copies a request's rows into an arena registered with its NIXL agent and answers a descriptor
(contract/nixl_descriptor.py); the consumer READs the rows and notifies, and the slot is free again."""
