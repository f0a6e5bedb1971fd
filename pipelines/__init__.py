"""Data pipelines: raw text -> tokenizer -> sharded TFRecords -> tf.data.

- `pipelines.prepare`: the `python -m pipelines.prepare` CLI that writes a
  data directory (tokenizer, train/val TFRecord shards, manifest.json), in
  parallel over chunks of the input and resumably; a package with one
  module per step (scan, tokenizer_training, encoding, shard_writer,
  commit), `resume`, `progress`, `run` (`prepare()`) and `cli`.
- `pipelines.manifest`: what a data directory holds: the manifest's schema,
  the record formats and the file names, shared by the writer and readers.
- `pipelines.sources`: input files (text, JSON Lines, `.jsonl.zst`), TFDS
  splits, and their cutting into chunks.
- `pipelines.tokenizer`: the SentencePiece `Tokenizer` used by training and
  sampling code (`Tokenizer.load` also returns WordPiece tokenizers).
- `pipelines.wordpiece_tokenizer`: BERT's WordPiece via TensorFlow Text.
- `pipelines.tfrecord`: TFRecord and `tf.train.Example` bytes without TensorFlow.
- `pipelines.files`: atomic writes and file checksums.
- `pipelines.reader`: `make_dataset(...)`, the GPT (packed tokens) input pipeline.
- `pipelines.encoder_data`: `make_encoder_dataset(...)`, BERT/ALBERT
  pretraining examples (masked LM, sentence order, next sentence).
- `pipelines.default_corpus`: the built-in corpus (Python's own docs).

Importing this package does not import TensorFlow; of its modules only
`reader` and `encoder_data` do, and `prepare` loads it only for TFDS
inputs and WordPiece tokenizers.
"""
