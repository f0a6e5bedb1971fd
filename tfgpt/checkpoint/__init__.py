"""One checkpoint format for every layout: chunks of global tensors, one index.

Every layout (one process, data parallel, ZeRO 1-3, tensor and pipeline
parallel, all of them at once) saves its state as regions of the whole
model's tensors keyed by their paths (`state`), each rank its own, the
chief's index last (`files`); any layout resumes from any other, and one
process reads the whole model (`run.load_weights`).
"""

from tfgpt.checkpoint.files import latest, write_json_atomically
from tfgpt.checkpoint.run import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    RunCheckpointer,
    load_weights,
    read_config,
    save_weights,
    write_run_files,
)

__all__ = [
    "CONFIG_FILE", "TOKENIZER_FILE", "RunCheckpointer", "latest", "load_weights", "read_config",
    "save_weights", "write_json_atomically", "write_run_files",
]
