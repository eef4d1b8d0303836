"""Independent references and shared fixtures for tests and benchmarks (neither owns them).

- transformers_kimi: transformers' own Kimi-K2.5 model, the encoder's oracle;
- checkpoint_processor: the checkpoint processor's pixel arithmetic restated with Pillow + numpy;
- random_checkpoint: seeded random checkpoints in the original on-disk layout;
- jpeg_corpus: generated JPEGs covering what the exact GPU decoder must equal Pillow on.

Nothing here imports backends/: each oracle restates the published rule (docs/kimi_k25.md), so that a
bug in our code is not copied into the reference that should catch it.
"""
