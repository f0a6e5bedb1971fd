"""Step 4 of `pipelines.prepare`, writing: one chunk's records of one split, in shards.

`SplitWriter` packs documents into records (`packed`: a token stream cut
into records of `seq_len + 1` tokens; `encoder`: a document's segments,
from `split_segments`, grouped into records of at most `seq_len - 3`
tokens; `instructions`: one example per record, or with `pack` several,
best fit), frames them with `pipelines.tfrecord` (no TensorFlow) and rolls a
new shard before one would pass `--shard-size` bytes. Each chunk writes its
own temporary shards, so chunks can be written in any order and a
finished chunk survives a crash; the commit gives them their final names.
"""

import bisect
import collections
import os
import re
from typing import List

import numpy as np

from pipelines.manifest import (
    ENCODER_FEATURES,
    INSTRUCTION_FEATURES,
    SEGMENT_FEATURE,
    SPLITS,
)
from pipelines.tfrecord import (
    FRAMING_BYTES,
    TFRecordWriter,
    serialize_example,
    serialize_records,
)

# A chunk's shards until the commit: `.{split}-c{chunk:05d}-{index:05d}.tfrecord.tmp`
# (group 2 names the chunk; shards of runs before chunking have none).
TEMPORARY_SHARD_PATTERN = re.compile(rf"^\.({'|'.join(SPLITS)})-(c\d{{5}}-)?\d{{5}}\.tfrecord\.tmp$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def temporary_shard_name(split: str, chunk_index: int, index: int) -> str:
    """The name of a chunk's shard until the commit renames it."""
    return f".{split}-c{chunk_index:05d}-{index:05d}.tfrecord.tmp"


def split_segments(text: str) -> List[str]:
    """Cut a document into segments: its lines, then sentences (a `.`, `!` or `?` then space)."""
    segments = []
    for line in text.split("\n"):
        for sentence in _SENTENCE_END.split(line.strip()):
            if sentence.strip():
                segments.append(sentence)
    return segments


def best_fit(lengths: List[int], capacity: int) -> List[List[int]]:
    """Best-fit decreasing bin packing: the indices of `lengths` in bins of
    at most `capacity`, each bin's in the order they went in.

    Longest first (ties in input order), each item goes to the bin it
    leaves the least room in, or to a new bin. Deterministic, and within
    11/9 of the fewest bins plus one (Johnson 1973).

    Args:
        lengths: list of int, each at most `capacity`.
        capacity: int. A bin's room.
    """
    bins: List[List[int]] = []
    rooms: List[int] = []  # sorted: the room left in the open bins
    by_room = collections.defaultdict(collections.deque)  # room -> bins, oldest first
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        place = bisect.bisect_left(rooms, length)
        if place < len(rooms):  # the fullest bin it fits in
            room = rooms.pop(place)
            number = by_room[room].popleft()
            if by_room[room]:
                bisect.insort(rooms, room)
        else:
            room, number = capacity, len(bins)
            bins.append([])
        bins[number].append(index)
        room -= length
        if room > 0:
            if not by_room[room]:
                bisect.insort(rooms, room)
            by_room[room].append(number)
    return bins


class SplitWriter:
    """Writes one chunk's records of one split and rolls shards by size.

    Packed format: documents (each followed by EOS) are packed into records
    of exactly `record_length` tokens; the partial record left at the end of
    the chunk is dropped. Encoder format: each document's segments are
    grouped into records of at most `record_length` tokens. Instruction
    format: each example one record, or (`pack`) the chunk's examples packed
    best fit (`best_fit`) into records of at most `record_length` tokens,
    written when the writer closes.

    Args:
        split: str. "train" or "val".
        directory: str. The output directory.
        chunk_index: int. Names the temporary shards.
        record_length: int. `seq_len + 1` (packed) or `seq_len - 3` (encoder).
        shard_size: int. A shard is closed before a record would take it past
            this many (uncompressed) bytes; a shard holds at least one record.
        compression: None or "GZIP".
        record_format: str. "packed", "encoder" or "instructions".
        pack: bool. Instructions: several examples to a record.
    """

    def __init__(
        self,
        split,
        directory,
        chunk_index,
        record_length,
        shard_size,
        compression=None,
        record_format="packed",
        pack=False,
    ):
        self.split = split
        self.directory = directory
        self.chunk_index = chunk_index
        self.record_length = record_length
        self.shard_size = shard_size
        self.compression = compression
        self.record_format = record_format
        self.pack = pack
        self._examples = []  # pack: (token ids, learned) until close
        self.shards = []  # dicts: temporary_name, sequences, tokens, bytes, sha256.
        self.documents = 0
        self.tokens = 0
        self.segments = 0
        self.dropped_tokens = 0
        self.learned_tokens = 0
        self.dropped_examples = 0
        self.truncated_examples = 0
        self._carry = np.zeros((0,), dtype=np.int64)
        self._writer = None
        self._current = None
        self._current_tokens = 0

    def add_documents(self, token_lists: List[List[int]], eos_id: int) -> None:
        """Packed format: append documents (each followed by EOS); write full records."""
        if not token_lists:
            return
        lengths = [len(token_ids) + 1 for token_ids in token_lists]
        stream = np.full(sum(lengths), eos_id, dtype=np.int64)
        position = 0
        for token_ids, length in zip(token_lists, lengths):
            stream[position : position + length - 1] = token_ids
            position += length
        self.documents += len(token_lists)
        self.tokens += len(stream)
        stream = np.concatenate([self._carry, stream])
        number_of_records = len(stream) // self.record_length
        records = stream[: number_of_records * self.record_length].reshape(
            number_of_records, self.record_length
        )  # (records, seq_len + 1)
        self._carry = stream[number_of_records * self.record_length :].copy()
        for serialized in serialize_records(records):
            self._current_tokens = self.record_length
            self._write_record(serialized)

    def add_examples(self, examples, eos_id: int, too_long: str) -> None:
        """Instruction format: each example, `[(token ids, learned)]` pieces,
        is one record: the pieces' tokens and EOS, `learned` 1 on the tokens
        of learned pieces and on EOS. An example longer than a record is
        dropped or (`too_long` "truncate") cut to one; either way counted.
        A cut that would keep no learned token drops the example. With
        `pack` the examples wait for `close`, which packs them."""
        for pieces in examples:
            self.documents += 1
            token_ids = [token for ids, _ in pieces for token in ids] + [eos_id]
            learned = [int(flag) for ids, flag in pieces for _ in ids] + [1]
            if len(token_ids) > self.record_length:
                kept = learned[1:self.record_length]  # (the first token is no one's target)
                if too_long == "drop" or not any(kept):
                    self.dropped_examples += 1
                    self.dropped_tokens += len(token_ids)
                    continue
                self.truncated_examples += 1
                self.dropped_tokens += len(token_ids) - self.record_length
                token_ids, learned = (token_ids[:self.record_length],
                                      learned[:self.record_length])
            self.tokens += len(token_ids)
            self.learned_tokens += sum(learned[1:])
            if self.pack:
                self._examples.append((token_ids, learned))
                continue
            self._current_tokens = len(token_ids)
            self._write_record(serialize_example(
                dict(zip(INSTRUCTION_FEATURES, (token_ids, learned)))))

    def _write_packed_examples(self) -> None:
        """Pack the examples held (`pack`) into records, best fit; each
        token's `segment_ids` is its example's number in the record, from 1."""
        examples, self._examples = self._examples, []
        for numbers in best_fit([len(ids) for ids, _ in examples], self.record_length):
            token_ids, learned, segment_ids = [], [], []
            for segment, number in enumerate(numbers, start=1):
                ids, flags = examples[number]
                token_ids += ids
                learned += flags
                segment_ids += [segment] * len(ids)
            self._current_tokens = len(token_ids)
            self._write_record(serialize_example({
                **dict(zip(INSTRUCTION_FEATURES, (token_ids, learned))),
                SEGMENT_FEATURE: segment_ids,
            }))

    def add_segmented_documents(self, documents: List[List[List[int]]]) -> None:
        """Encoder format: each document is a list of segments (token lists)."""
        limit = self.record_length
        for segments in documents:
            self.documents += 1
            group, group_tokens = [], 0
            for segment in segments:
                if not segment:
                    continue
                self.tokens += len(segment)
                for start in range(0, len(segment), limit):
                    piece = segment[start : start + limit]
                    if group and group_tokens + len(piece) > limit:
                        self._write_group(group, group_tokens)
                        group, group_tokens = [], 0
                    group.append(piece)
                    group_tokens += len(piece)
            if group:
                self._write_group(group, group_tokens)

    def _write_group(self, group, group_tokens) -> None:
        if group_tokens < 2:  # No A/B pair can be made.
            self.dropped_tokens += group_tokens
            return
        self.segments += len(group)
        serialized = serialize_example(
            {
                ENCODER_FEATURES[0]: [token for piece in group for token in piece],
                ENCODER_FEATURES[1]: [len(piece) for piece in group],
            }
        )
        self._current_tokens = group_tokens
        self._write_record(serialized)

    def _write_record(self, serialized: bytes) -> None:
        size = len(serialized) + FRAMING_BYTES
        if (
            self._current is not None
            and self._current["uncompressed_bytes"] + size > self.shard_size
        ):
            self._close_shard()
        if self._current is None:
            self._open_shard()
        self._writer.write(serialized)
        self._current["uncompressed_bytes"] += size
        self._current["sequences"] += 1
        self._current["tokens"] += self._current_tokens

    def _open_shard(self) -> None:
        name = temporary_shard_name(self.split, self.chunk_index, len(self.shards))
        self._current = {
            "temporary_name": name,
            "sequences": 0,
            "tokens": 0,
            "uncompressed_bytes": 0,
        }
        self.shards.append(self._current)
        self._writer = TFRecordWriter(os.path.join(self.directory, name), self.compression)

    def _close_shard(self) -> None:
        closed = self._writer.close()
        self._writer = None
        self._current["bytes"] = closed["bytes"]
        self._current["sha256"] = closed["sha256"]
        del self._current["uncompressed_bytes"]
        self._current = None

    def close(self) -> None:
        """Write the packed examples held, close the last shard. A packed
        partial record left over is dropped."""
        if self._examples:
            self._write_packed_examples()
        if self._current is not None:
            self._close_shard()

    def abort(self) -> None:
        """Close the open writer without finishing (used on errors)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    @property
    def sequences(self) -> int:
        return sum(shard["sequences"] for shard in self.shards)

    @property
    def dropped_tail_tokens(self) -> int:
        return len(self._carry) + self.dropped_tokens

    def summary(self) -> dict:
        summary = {
            "documents": self.documents,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "dropped_tail_tokens": self.dropped_tail_tokens,
            "shards": [dict(shard) for shard in self.shards],
        }
        if self.record_format == "encoder":
            summary["segments"] = self.segments
        if self.record_format == "instructions":
            summary.update(learned_tokens=self.learned_tokens,
                           dropped_examples=self.dropped_examples,
                           truncated_examples=self.truncated_examples)
        return summary
