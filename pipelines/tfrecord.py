"""TFRecord files and `tf.train.Example` bytes, written without TensorFlow.

`pipelines.prepare` runs one process per core; importing TensorFlow costs
each of them about 600 MB of memory and 7 s of start-up, only to frame
records. This module writes the same bytes with NumPy, `google-crc32c` and
the standard library:

- `serialize_records(records)`: packed-token Examples (one int64 feature,
  `input_ids`), byte-for-byte what protobuf produces (tested against it).
- `serialize_example(features)`: an Example with several int64 list
  features (the encoder format: `token_ids`, `segment_lengths`).
- `TFRecordWriter(path, compression)`: TFRecord framing (length, masked
  CRC-32C of the length, data, masked CRC-32C of the data), optional GZIP
  with a fixed header (no name, mtime 0) so the file is byte-identical
  across runs, SHA-256 of the bytes on disk computed while writing, and an
  fsync on close.

Example:

>>> import numpy as np
>>> serialized = serialize_records(np.array([[5, 6, 7]]))
>>> len(serialized)
1
"""

import gzip
import hashlib
import os
import struct
from typing import Dict, List, Optional, Sequence

import google_crc32c
import numpy as np

from pipelines.manifest import COMPRESSIONS as COMPRESSION_TYPES
from pipelines.manifest import PACKED_FEATURE

# TFRecord framing per record: uint64 length, uint32 length CRC, uint32 data CRC.
FRAMING_BYTES = 16
_CRC_MASK_DELTA = 0xA282EAD8


def _varint(value: int) -> bytes:
    """Protocol-buffer base-128 varint of a non-negative int."""
    encoded = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            encoded.append(byte | 0x80)
        else:
            encoded.append(byte)
            return bytes(encoded)


def _length_delimited(field_tag: int, payload: bytes) -> bytes:
    return bytes([field_tag]) + _varint(len(payload)) + payload


def _packed_varints(values: np.ndarray):
    """Varint bytes of a 2-D non-negative array, and each row's byte count.

    Returns:
        (bytes, list of int): all rows' varints back to back (row-major), and
        the end offset of each row in those bytes.
    """
    values = values.astype(np.int64, copy=False)  # (N, R)
    largest = int(values.max()) if values.size else 0
    maximum_bytes = max(1, (largest.bit_length() + 6) // 7)
    # Varint length of every value: 1 byte per started group of 7 bits.
    byte_counts = np.ones(values.shape, dtype=np.int64)  # (N, R)
    for group in range(1, maximum_bytes):
        byte_counts += values >= (1 << (7 * group))
    varint_bytes = np.empty(values.shape + (maximum_bytes,), dtype=np.uint8)  # (N, R, B)
    for group in range(maximum_bytes):
        low_bits = (values >> (7 * group)) & 0x7F
        continuation = (byte_counts > group + 1) * 0x80
        varint_bytes[:, :, group] = low_bits | continuation
    used = np.arange(maximum_bytes) < byte_counts[:, :, None]  # (N, R, B)
    # Boolean indexing keeps row-major order: record by record, value by value.
    packed = varint_bytes[used].tobytes()
    ends = np.cumsum(byte_counts.sum(axis=1)).tolist()  # (N,)
    return packed, ends


def _int64_feature_entry(name: str, packed_values: bytes) -> bytes:
    """One `Features.feature` map entry holding a packed Int64List."""
    int64_list = _length_delimited(0x0A, packed_values)  # Int64List.value = 1, packed
    feature = _length_delimited(0x1A, int64_list)  # Feature.int64_list = 3
    map_entry = _length_delimited(0x0A, name.encode("utf-8"))  # MapEntry.key = 1
    map_entry += _length_delimited(0x12, feature)  # MapEntry.value = 2
    return _length_delimited(0x0A, map_entry)  # Features.feature = 1


def serialize_records(records: np.ndarray, feature_name: str = PACKED_FEATURE) -> List[bytes]:
    """Serialize records as `tf.train.Example`s with one int64 feature.

    Byte-for-byte what protobuf produces for
    `Example(features=Features(feature={"input_ids": Feature(int64_list=Int64List(value=ids))}))`
    (the tests compare against protobuf), but vectorized with NumPy: building
    one protobuf message per record in Python costs more than the encoding.

    Args:
        records: int array of shape (number_of_records, record_length), with
            non-negative values (token ids).
        feature_name: str. The feature's key.

    Returns:
        list of bytes, one serialized Example per record.
    """
    records = np.asarray(records)
    if records.ndim != 2:
        raise ValueError(f"`records` must be 2-D. Received: shape {records.shape}")
    if records.size and records.min() < 0:
        raise ValueError(f"`records` must be non-negative. Received: minimum {records.min()}")
    packed, ends = _packed_varints(records)
    # Everything before the packed values depends only on their byte length,
    # and a batch has few distinct lengths: build each prefix once.
    prefixes = {}
    serialized = []
    start = 0
    for end in ends:
        length = end - start
        prefix = prefixes.get(length)
        if prefix is None:
            example = _length_delimited(0x0A, _int64_feature_entry(feature_name, b"\0" * length))
            prefix = prefixes[length] = example[: len(example) - length]
        serialized.append(prefix + packed[start:end])
        start = end
    return serialized


def serialize_example(features: Dict[str, Sequence[int]]) -> bytes:
    """Serialize one `tf.train.Example` of int64 list features (non-negative values).

    Args:
        features: dict from feature name to a sequence of non-negative ints
            (possibly empty), written in the dict's order.

    Returns:
        bytes.
    """
    entries = b""
    for name, values in features.items():
        values = np.asarray(values, dtype=np.int64).reshape(1, -1)  # (1, L)
        if values.size and values.min() < 0:
            raise ValueError(
                f"`features[{name!r}]` must be non-negative. Received: minimum {values.min()}"
            )
        packed, _ = _packed_varints(values)
        entries += _int64_feature_entry(name, packed)
    return _length_delimited(0x0A, entries)  # Example.features = 1


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


_LENGTH_HEADERS = {}


def frame_record(data: bytes) -> bytes:
    """One record in TFRecord framing."""
    header = _LENGTH_HEADERS.get(len(data))
    if header is None:
        length = struct.pack("<Q", len(data))
        header = length + struct.pack("<I", masked_crc32c(length))
        if len(_LENGTH_HEADERS) < 4096:
            _LENGTH_HEADERS[len(data)] = header
    return header + data + struct.pack("<I", masked_crc32c(data))


class _HashingFile:
    """A binary file that hashes everything written to it (the on-disk bytes)."""

    def __init__(self, path: str):
        self.file = open(path, "xb")
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class TFRecordWriter:
    """Writes one TFRecord file, optionally GZIP-compressed, and fsyncs it on close.

    The file is created exclusively (an existing file is an error, so two
    writers never share a path).

    Args:
        path: str. The file to create.
        compression: None or "GZIP".

    Example:

    >>> writer = TFRecordWriter("/tmp/example.tfrecord")  # doctest: +SKIP
    >>> writer.write(b"payload")  # doctest: +SKIP
    >>> writer.close()["sha256"]  # doctest: +SKIP
    '...'
    """

    def __init__(self, path: str, compression: Optional[str] = None):
        if compression not in COMPRESSION_TYPES:
            raise ValueError(
                f"`compression` must be one of {COMPRESSION_TYPES}. "
                f"Received: compression={compression!r}"
            )
        self.path = path
        self.records = 0
        self.uncompressed_bytes = 0
        self._raw = _HashingFile(path)
        self._compressor = None
        if compression == "GZIP":
            # No file name and mtime 0 in the header: identical input gives an
            # identical file. Level 6 is zlib's default speed/size trade-off.
            self._compressor = gzip.GzipFile(
                filename="", mode="wb", fileobj=self._raw, compresslevel=6, mtime=0
            )
        self._sink = self._compressor if self._compressor is not None else self._raw

    def write(self, data: bytes) -> None:
        """Append one record."""
        framed = frame_record(data)
        self._sink.write(framed)
        self.records += 1
        self.uncompressed_bytes += len(framed)

    def close(self) -> dict:
        """Finish the file, fsync it, and return `{bytes, sha256, records}`."""
        if self._compressor is not None:
            self._compressor.close()
        self._raw.file.flush()
        os.fsync(self._raw.file.fileno())
        self._raw.file.close()
        return {
            "bytes": self._raw.size,
            "sha256": self._raw.digest.hexdigest(),
            "records": self.records,
        }

    def abort(self) -> None:
        """Close without finishing (on errors); the caller removes the file."""
        try:
            self._raw.file.close()
        except OSError:
            pass
