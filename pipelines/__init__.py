"""Data pipelines: raw text -> tokenizer -> sharded TFRecords -> tf.data.

- `pipelines.prepare`: the `python -m pipelines.prepare` CLI that writes a
  data directory (tokenizer.model, train/val TFRecord shards, manifest.json).
- `pipelines.tokenizer`: the `Tokenizer` used by training and sampling code.
- `pipelines.reader`: `make_dataset(...)`, the tf.data input pipeline.
- `pipelines.default_corpus`: the built-in corpus (Python's own docs).

Importing this package does not import TensorFlow.
"""
