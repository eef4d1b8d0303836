"""The embedding cache: a media's embedding rows, keyed by a hash of its encoded bytes and of everything
that changes them, kept by the encoder under a byte budget (docs/design.md#the-embedding-cache)."""
