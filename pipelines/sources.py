"""Input documents for `pipelines.prepare`: files, globs, directories, TFDS, in chunks.

Input kinds, chosen by file name:

- `.jsonl`, `.json`: JSON Lines, one document per non-blank line, the line's
  string `text` field (the Pile's format).
- `.jsonl.zst`, `.json.zst`: the same, Zstandard-compressed (the Pile's
  files). Decompressed as a stream, never whole in memory.
- `.zst` (any other): plain text, Zstandard-compressed.
- anything else: plain UTF-8 text; a document is a block of consecutive
  non-blank lines, separated by one or more blank (whitespace-only) lines.
  The lines of a block are kept verbatim (CRLF becomes LF), joined by `\\n`.
- the built-in corpus (`pipelines.default_corpus`, Python's own docs) when
  no input is given (kind "default", one unsplittable source).
- a TensorFlow Datasets split (`tfds_specs`, e.g. `"wikipedia/20230601.en:train"`),
  read from a `data_dir` the user has already prepared (never downloaded);
  one document per example, its `text` feature (`text_key`).

Chunks: the unit of parallel work and of resuming. The inputs, in order,
are cut into chunks of about `chunk_size` bytes (on-disk bytes): small files
share a chunk, large plain files are cut at byte offsets. A document
belongs to the chunk its start falls in, by these rules, which both sides
of a cut apply identically, so no document is read twice or lost:

- JSON Lines: the line starting at offset `o` belongs to the chunk
  `[start, end)` with `start <= o < end`.
- Plain text: a block belongs to the chunk holding the offset of the blank
  line just before it (offset 0 for a file's first block).

Compressed files and TFDS splits cannot be cut; each lies whole in one
chunk. Chunking depends only on the inputs and `chunk_size`, never on the
number of worker processes.

Instruction examples (`prepare --format instructions`, `text_key=None`):
each JSON line is one example, `{"prompt": ..., "completion": ...}` (the
completion is what the model learns), `{"messages": [{"role", "content"},
...]}` (a conversation rendered with the chat template, its assistant
turns learned: `pipelines.chat_template`) or `{"text": ...}` (all of it
learned); the built-in corpus gives one conversation per document, its
first sentence the user's turn and the rest the reply. A document is then
`example_document(pieces)`, the example's text in pieces, each learned or
not, which `parse_example_document` reads back. Plain text and TFDS inputs
have no examples.

Memory: documents are read one at a time; the largest document must fit.
"""

import dataclasses
import glob
import json
import os
import re
from typing import Iterator, List, Optional, Sequence, Tuple

from pipelines.errors import DataError

_FIRST_SENTENCE = re.compile(r"(?<=[.!?:])\s+")
JSON_LINES_SUFFIXES = (".jsonl", ".json")
ZSTD_JSON_LINES_SUFFIXES = (".jsonl.zst", ".json.zst")
DIRECTORY_SUFFIXES = (".txt", ".jsonl", ".jsonl.zst")
TFDS_PREFIX = "tfds:"


@dataclasses.dataclass(frozen=True)
class Source:
    """One input: a file or a TFDS split.

    Args:
        path: str. The file, or `tfds:NAME:SPLIT` for a TFDS split.
        kind: str. "text", "jsonl", "jsonl.zst", "text.zst", "tfds" or "default".
        size: int. Bytes on disk (0 for TFDS).
    """

    path: str
    kind: str
    size: int

    @property
    def splittable(self) -> bool:
        return self.kind in ("text", "jsonl")


# ----------------------------------------------------------------------------
# Resolving inputs.


def resolve_inputs(patterns: Sequence[str]) -> List[str]:
    """Expand files, globs and directories into a list of input files.

    Args:
        patterns: sequence of str. Each is a file, a glob (`*`, `?`, `[`; `**`
            recurses) or a directory (every `*.txt`, `*.jsonl` and
            `*.jsonl.zst` below it).

    Returns:
        list of str. Files in the order given, each glob's and directory's
        matches sorted, duplicates removed (first occurrence kept).
    """
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(f"{pattern}: no input files match this glob")
        elif os.path.exists(pattern):
            matches = [pattern]
        else:
            raise DataError(f"{pattern}: input file or directory not found")
        for match in matches:
            if os.path.isdir(match):
                found = _files_in_directory(match)
                if not found:
                    raise DataError(
                        f"{match}: directory contains no *.txt or *.jsonl files "
                        "(nor *.jsonl.zst)"
                    )
                files.extend(found)
            else:
                files.append(match)
    return list(dict.fromkeys(files))


def _files_in_directory(directory: str) -> List[str]:
    found = []
    for root, subdirectories, filenames in os.walk(directory):
        subdirectories.sort()
        for filename in filenames:
            if filename.endswith(DIRECTORY_SUFFIXES):
                found.append(os.path.join(root, filename))
    return sorted(found)


def file_kind(path: str) -> str:
    """The input kind of a file, from its name."""
    if path.endswith(ZSTD_JSON_LINES_SUFFIXES):
        return "jsonl.zst"
    if path.endswith(".zst"):
        return "text.zst"
    if path.endswith(JSON_LINES_SUFFIXES):
        return "jsonl"
    return "text"


def make_sources(files: Sequence[str], tfds_specs: Sequence[str] = ()) -> List[Source]:
    """Sources for resolved files (sizes from `stat`) followed by TFDS splits."""
    sources = []
    for path in files:
        try:
            size = os.stat(path).st_size
        except OSError as error:
            raise DataError(f"{path}: cannot read input file ({error.strerror})") from None
        sources.append(Source(path, file_kind(path), size))
    for spec in tfds_specs:
        name, split = parse_tfds_spec(spec)
        sources.append(Source(f"{TFDS_PREFIX}{name}:{split}", "tfds", 0))
    return sources


def parse_tfds_spec(spec: str) -> Tuple[str, str]:
    """`NAME[:SPLIT]` -> (name, split); the split defaults to "train"."""
    if spec.startswith(TFDS_PREFIX):
        spec = spec[len(TFDS_PREFIX) :]
    name, _, split = spec.partition(":")
    if not name:
        raise ValueError(f"`tfds` must be NAME or NAME:SPLIT. Received: tfds={spec!r}")
    return name, split or "train"


def fingerprint(sources: Sequence[Source]) -> List[list]:
    """What identifies the inputs' contents cheaply: path, size, mtime (ns)."""
    result = []
    for source in sources:
        if source.kind == "default":
            from pipelines import default_corpus

            result.append([default_corpus.describe(), 0, 0])
        elif source.kind == "tfds":
            result.append([source.path, 0, 0])
        else:
            status = os.stat(source.path)
            result.append([os.path.abspath(source.path), status.st_size, status.st_mtime_ns])
    return result


# ----------------------------------------------------------------------------
# Chunking.


def plan_chunks(sources: Sequence[Source], chunk_size: int) -> List[List[list]]:
    """Cut the sources into chunks of about `chunk_size` on-disk bytes.

    Returns:
        list of chunks; a chunk is a list of segments `[source_index, start,
        end]` (byte offsets; `end` None means to the end of the input).
    """
    chunks, current, current_size = [], [], 0
    for index, source in enumerate(sources):
        if not source.splittable:
            current.append([index, 0, None])
            current_size += source.size
        else:
            start = 0
            while True:
                room = max(chunk_size - current_size, 1)
                if source.size - start <= room:
                    current.append([index, start, None])
                    current_size += source.size - start
                    break
                current.append([index, start, start + room])
                start += room
                chunks.append(current)
                current, current_size = [], 0
        if current_size >= chunk_size:
            chunks.append(current)
            current, current_size = [], 0
    if current:
        chunks.append(current)
    return chunks


def chunk_input_bytes(sources: Sequence[Source], segments: Sequence[list]) -> int:
    """On-disk bytes a chunk covers (for progress)."""
    total = 0
    for source_index, start, end in segments:
        size = sources[source_index].size
        total += (size if end is None else min(end, size)) - min(start, size)
    return total


def describe_chunk(sources: Sequence[Source], segments: Sequence[list]) -> str:
    """A chunk's segments for messages, e.g. `a.jsonl bytes 0-1048576, b.txt`."""
    parts = []
    for source_index, start, end in segments:
        path = sources[source_index].path
        if start == 0 and end is None:
            parts.append(path)
        else:
            parts.append(f"{path} bytes {start}-{'end' if end is None else end}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------
# Reading documents.


def _zstd_lines(raw_file, path: str) -> Iterator[bytes]:
    """The lines of a Zstandard file (one or more frames), decompressed as a stream.

    Raises DataError naming the file for corrupt data and for a stream that
    ends inside a frame (a truncated download), which a plain stream reader
    would take for a clean end.
    """
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame = decompressor.decompressobj()
    frame_started = False
    pending = b""
    try:
        while True:
            data = raw_file.read(1 << 20)
            if not data:
                break
            while data:
                frame_started = True
                pending += frame.decompress(data)
                if frame.eof:  # Concatenated frames: start the next one.
                    data = frame.unused_data
                    frame = decompressor.decompressobj()
                    frame_started = False
                else:
                    data = b""
            lines = pending.split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line + b"\n"
    except zstandard.ZstdError as error:
        raise DataError(f"{path}: corrupt Zstandard stream ({error})") from None
    if frame_started and not frame.eof:
        raise DataError(f"{path}: corrupt Zstandard stream (truncated: it ends inside a frame)")
    if pending:
        yield pending


def example_document(pieces: Sequence[Tuple[str, bool]]) -> str:
    """One instruction example, `[(text, learned)]`, as the document the pipeline carries (JSON)."""
    return json.dumps([[text, bool(learned)] for text, learned in pieces], ensure_ascii=False)


def parse_example_document(document: str) -> List[Tuple[str, bool]]:
    """`[(text, learned)]` of an `example_document`."""
    return [(text, learned) for text, learned in json.loads(document)]


def _example(record, where: str, chat) -> List[Tuple[str, bool]]:
    """`[(text, learned)]` of a JSON line's object (`chat`: the
    `pipelines.chat_template.ChatTemplate` of "messages"), or DataError
    naming `where`."""
    from pipelines.chat_template import check_messages

    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got a JSON {type(record).__name__}")
    if "messages" in record:
        if set(record) - {"messages"}:
            raise DataError(f'{where}: "messages" come alone, got also '
                            f"{sorted(set(record) - {'messages'})[:5]}")
        messages = check_messages(record["messages"], where)
        try:
            return chat.segments(messages)
        except ValueError as error:
            raise DataError(f"{where}: {error}") from None
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise DataError(f'{where}: "{name}" must be a string, got '
                                f"{'nothing' if value is None else type(value).__name__}")
        if not completion.strip():
            raise DataError(f'{where}: the "completion" is empty: nothing to learn')
        return [(prompt, False), (completion, True)]
    if isinstance(record.get("text"), str):
        return [(record["text"], True)]
    raise DataError(f'{where}: expected "prompt" and "completion", "messages" or "text", got '
                    f"the keys {sorted(record)[:5]}")


def default_corpus_example(document: str, chat) -> Optional[List[Tuple[str, bool]]]:
    """A built-in corpus document as an example: a conversation rendered with
    the `chat` template, its first sentence the user's turn and the rest the
    reply (None for a document of one sentence)."""
    parts = _FIRST_SENTENCE.split(document.strip(), maxsplit=1)
    if len(parts) < 2 or not parts[1].strip():
        return None
    return chat.segments([{"role": "user", "content": parts[0]},
                          {"role": "assistant", "content": parts[1]}])


class SegmentReader:
    """The documents of one segment of one source.

    Iterating yields str documents; `consumed` is the number of on-disk bytes
    of the source read so far (for progress; 0 for TFDS and the default
    corpus, which have no size), `empty_documents` the number of
    whitespace-only texts skipped.

    Args:
        source: Source.
        start: int. First byte offset of the segment.
        end: int or None. End offset (exclusive), None for the end.
        text_key: str. JSON / TFDS feature holding the text; None: instruction
            examples (see the module docstring).
        tfds_data_dir: str or None. TFDS data directory.
        chat: `pipelines.chat_template.ChatTemplate` of instruction
            examples' "messages", or None.
    """

    def __init__(
        self, source: Source, start: int, end: Optional[int], *, text_key="text",
        tfds_data_dir=None, chat=None,
    ):
        self.source = source
        self.start = start
        self.end = end
        self.text_key = text_key
        self.tfds_data_dir = tfds_data_dir
        self.chat = chat
        self.consumed = 0
        self.empty_documents = 0
        self.documents = 0

    def __iter__(self) -> Iterator[str]:
        kind = self.source.kind
        if self.text_key is None and kind not in ("default", "jsonl", "jsonl.zst"):
            raise DataError(
                f"{self.source.path}: instruction examples come from JSON Lines files (or the "
                "built-in corpus), not plain text or TFDS")
        if kind == "default":
            from pipelines import default_corpus

            texts = default_corpus.iter_documents()
            if self.text_key is None:
                texts = (example_document(example) if example else ""
                         for example in (default_corpus_example(text, self.chat)
                                         for text in texts))
        elif kind == "tfds":
            texts = self._tfds_texts()
        elif kind in ("jsonl", "jsonl.zst"):
            texts = self._json_lines_texts()
        else:
            texts = self._text_blocks()
        for text in texts:
            if not text.strip():
                self.empty_documents += 1
                continue
            self.documents += 1
            yield text

    # Lines -----------------------------------------------------------------

    def _location(self, line_number: Optional[int], offset: Optional[int]) -> str:
        if line_number is not None:
            return f"{self.source.path}:{line_number}"
        return f"{self.source.path} (line at byte {offset})"

    def _open_error(self, error: OSError) -> DataError:
        return DataError(f"{self.source.path}: cannot read input file ({error.strerror})")

    def _lines(self) -> Iterator[Tuple[Optional[int], Optional[int], bytes]]:
        """Yields (line_number or None, offset or None, raw line) of the segment's lines.

        For cut files reading starts at the first line starting at or after
        `start`; line numbers are known only when reading from the start.
        """
        path = self.source.path
        try:
            raw_file = open(path, "rb")
        except OSError as error:
            raise self._open_error(error) from None
        with raw_file:
            compressed = self.source.kind.endswith(".zst")
            if compressed:
                stream = _zstd_lines(raw_file, path)
                offset = None
            else:
                stream = raw_file
                offset = self.start
                if self.start > 0:
                    raw_file.seek(self.start - 1)
                    if raw_file.read(1) != b"\n":
                        skipped = raw_file.readline()  # The rest of a line begun earlier.
                        offset += len(skipped)
            line_number = 1 if self.start == 0 else None
            try:
                for line in stream:
                    if offset is not None:
                        self.consumed = offset + len(line) - self.start
                    else:
                        self.consumed = raw_file.tell()
                    yield line_number, offset, line
                    if offset is not None:
                        offset += len(line)
                    if line_number is not None:
                        line_number += 1
            except OSError as error:
                raise self._open_error(error) from None

    def _decode(self, line_number, offset, line: bytes) -> str:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(
                f"{self._location(line_number, offset)}: not valid UTF-8 "
                f"(byte {error.start} of the line)"
            ) from None
        if line_number == 1 and text.startswith("\ufeff"):
            text = text[1:]  # A UTF-8 byte order mark is not part of the text.
        return text

    # Kinds -----------------------------------------------------------------

    def _json_lines_texts(self) -> Iterator[str]:
        for line_number, offset, raw_line in self._lines():
            if self.end is not None and offset is not None and offset >= self.end:
                break
            line = self._decode(line_number, offset, raw_line)
            if not line.strip():
                continue
            where = self._location(line_number, offset)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where}: malformed JSON line ({error.msg}: column {error.colno})"
                ) from None
            if self.text_key is None:
                yield example_document(_example(record, where, self.chat))
                continue
            text = record.get(self.text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                if not isinstance(record, dict):
                    received = f"a JSON {type(record).__name__}"
                elif self.text_key not in record:
                    received = f"an object without it (keys: {sorted(record)[:5]})"
                else:
                    received = f"{self.text_key} of type {type(text).__name__}"
                raise DataError(
                    f'{where}: expected a JSON object with a string "{self.text_key}" '
                    f"field, got {received}"
                )
            yield text

    def _text_blocks(self) -> Iterator[str]:
        # A block belongs to the chunk holding the blank line just before it.
        # Cut files: skip to the first blank line at or after `start`; the
        # blocks before it belong to the previous chunk.
        seeking_blank = self.start > 0
        block = []
        last_blank = 0  # Offset of the latest blank line (0 before the first).
        for line_number, offset, raw_line in self._lines():
            line = self._decode(line_number, offset, raw_line).rstrip("\n").rstrip("\r")
            if not line.strip():
                if block:
                    yield "\n".join(block)
                    block = []
                last_blank = offset
                seeking_blank = False
                continue
            if seeking_blank:
                continue
            if not block and self.end is not None and last_blank is not None:
                if last_blank >= self.end:
                    return
            block.append(line)
        if block:
            yield "\n".join(block)

    def _tfds_texts(self) -> Iterator[str]:
        import tensorflow_datasets as tfds

        name, split = parse_tfds_spec(self.source.path)
        try:
            dataset = tfds.load(
                name,
                split=split,
                data_dir=self.tfds_data_dir,
                download=False,
                shuffle_files=False,
            )
        except Exception as error:  # tfds raises many types for a missing dataset.
            raise DataError(
                f"{self.source.path}: cannot load the TFDS split from "
                f"data_dir={self.tfds_data_dir!r} ({type(error).__name__}: {error})"
            ) from None
        for index, example in enumerate(tfds.as_numpy(dataset)):
            if self.text_key not in example:
                raise DataError(
                    f"{self.source.path}: example {index} has no {self.text_key!r} feature "
                    f"(features: {sorted(example)[:5]})"
                )
            value = example[self.text_key]
            yield value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ChunkReader:
    """Every document of a chunk, in order, with counters.

    Iterating yields `(source_index, document)`. `documents_per_source`
    counts the documents of each source seen, `empty_documents` the skipped
    whitespace-only texts.

    Args:
        sources: sequence of Source.
        segments: sequence of `[source_index, start, end]` (from `plan_chunks`).
        text_key: str. JSON / TFDS feature holding the text.
        tfds_data_dir: str or None.
        on_progress: callable taking an int, or None. Called with the on-disk
            bytes consumed since its previous call, at most once per document.
        chat: `SegmentReader`'s.
    """

    def __init__(self, sources, segments, *, text_key="text", tfds_data_dir=None, on_progress=None,
                 chat=None):
        self.sources = sources
        self.segments = segments
        self.text_key = text_key
        self.tfds_data_dir = tfds_data_dir
        self.chat = chat
        self.on_progress = on_progress
        self.empty_documents = 0
        self.documents_per_source = {}

    def __iter__(self) -> Iterator[Tuple[int, str]]:
        for source_index, start, end in self.segments:
            reader = SegmentReader(
                self.sources[source_index],
                start,
                end,
                text_key=self.text_key,
                tfds_data_dir=self.tfds_data_dir,
                chat=self.chat,
            )
            reported = 0
            for document in reader:
                if self.on_progress is not None and reader.consumed != reported:
                    self.on_progress(reader.consumed - reported)
                    reported = reader.consumed
                yield source_index, document
            if self.on_progress is not None and reader.consumed != reported:
                self.on_progress(reader.consumed - reported)
            self.empty_documents += reader.empty_documents
            self.documents_per_source[source_index] = (
                self.documents_per_source.get(source_index, 0) + reader.documents
            )
