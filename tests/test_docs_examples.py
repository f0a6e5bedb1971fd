"""Every example of README.md and docs/ runs, at tiny sizes, as a reader would.

The pages' ```bash and ```python blocks run in one working directory, page
after page in the order of a reader who starts at the quick start (PAGES):
the data a page prepares is what the next page trains on. The directory holds
what the commands name but a fresh clone lacks, made here: a JSON Lines and a
text corpus, prompt/completion pairs, a .jsonl.zst shard, SST-2 and SQuAD files, a GPT-2 and a Llama
directory (tiny random transformers models), and the names `make demo` leaves
(data/demo, runs/demo) pointing at the quick start's.

Each front-end command runs as written, with its sizes cut: a flag of TINY
gets TINY's value (a python block's keyword of TINY_KEYWORDS likewise),
and SHRINK's flags are added at its end (argparse keeps a
flag's last value), so the model, steps, sequence and vocabulary are tiny
while every other flag is the page's. A block that cannot run here says why
in a `<!-- not run: REASON -->` line right above it (a cluster, a GPU, a
download); its commands are still parsed by tests/test_docs.py.
"""

import json
import os
import random
import re
import shlex
import subprocess
import sys

import pytest

from tests.launch import REPO
from tests.synthetic import pattern_corpus, repeated_letter_corpus

# One group, so the pages run in order on one worker; its own, not the
# multi-process tests' (tests/conftest.py): its five `horovodrun -np 2` runs of
# 3 steps fit beside the single-process tests.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("docs")]

# A reader's order: what a page prepares or trains, a later page uses.
PAGES = ["README.md", "docs/training.md", "docs/data.md", "docs/parallel.md",
         "docs/elastic.md", "docs/finetuning.md", "docs/generation.md"]
PAGES += sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").glob("*.md")
                if str(path.relative_to(REPO)) not in PAGES)
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->\n\Z")
FRONT_ENDS = re.compile(
    r"^(train_hvd|train_mirrored|finetune_hvd|finetune_mirrored)\.py$"
    r"|^(pipelines\.prepare|tfgpt|tfgpt\.[a-z_]+|bench\.[a-z_]+)$")
# Values cut wherever a command gives the flag.
TINY = {"-np": "2", "--seq-len": "32", "--vocab-size": "300", "--workers": "2",
        "--steps": "3", "--batch-size": "4", "--microbatches": "2", "--epochs": "1",
        "--max-new-tokens": "8"}
# The same for the keyword arguments of the python blocks.
TINY_KEYWORDS = {"max_new_tokens": "8"}
# Added at the end of each front end's command.
SHRINK = {
    "train": ["--num-layers", "1", "--hidden-dim", "32", "--num-heads", "2",
              "--intermediate-dim", "64", "--max-sequence-length", "32",
              "--steps", "3", "--eval-batches", "1", "--log-every", "1"],
    "finetune": ["--steps", "2", "--batch-size", "4", "--max-sequence-length", "32",
                 "--max-query-length", "8", "--doc-stride", "8",
                 "--log-every", "1"],
}


def examples():
    """`(where, language, text, reason)` of every block, in PAGES order;
    `reason` is the block's not-run marker, or None."""
    found = []
    for page in PAGES:
        text = (REPO / page).read_text()
        for match in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            before = text[:match.start()].rsplit("\n", 2)[-2] + "\n"
            marker = NOT_RUN.match(before)
            found.append((f"{page}:{line}", match.group(1), match.group(2),
                          marker.group(1) if marker else None))
    return found


EXAMPLES = examples()


def front_end(words):
    """The front end's name in `words` ("train", "finetune" or the module), or None."""
    for index, word in enumerate(words):
        name = word.rsplit("/", 1)[-1]
        module = words[index + 1] if word == "-m" and index + 1 < len(words) else ""
        for candidate in (name, module):
            if FRONT_ENDS.match(candidate):
                return re.sub(r"_(hvd|mirrored)\.py$", "", candidate).replace(
                    "train_", "train")
    return None


def tiny(words):
    """`words` with TINY's values, `-H localhost:N` cut to match, and SHRINK's flags."""
    words = [word for word in words if word != "..." and not word.startswith("[")
             and not word.endswith("]")]
    for index, word in enumerate(words[:-1]):
        if word in TINY:
            words[index + 1] = TINY[word]
        elif word == "-H" and words[index + 1].startswith("localhost:"):
            words[index + 1] = "localhost:" + TINY["-np"]
    return words + SHRINK.get(front_end(words), [])


def commands(text):
    """The shell commands of a bash block, as word lists."""
    return [words for words in (shlex.split(line, comments=True)
                                for line in text.replace("\\\n", " ").splitlines()) if words]


def _gpt2_directory(directory):
    """A tiny random transformers GPT-2 with a byte-level BPE vocabulary."""
    import tokenizers
    import transformers

    directory.mkdir(parents=True)
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(["Hello, I'm a language model, a small one."] * 8,
                                vocab_size=300, min_frequency=2,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    trainer.save_model(str(directory))
    config = transformers.GPT2Config(vocab_size=trainer.get_vocab_size(), n_positions=64,
                                     n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(directory))


def _llama_directory(directory):
    import transformers

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=40,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))


def _squad(path, seed):
    rng = random.Random(seed)
    paragraphs = []
    for number in range(6):
        name = rng.choice(["Ada", "Alan", "Grace", "Edsger"])
        context = f"{name} wrote program {number} in the year {1950 + number}. It ran."
        paragraphs.append({"context": context, "qas": [
            {"id": f"q{seed}-{number}", "question": f"Who wrote program {number}?",
             "answers": [{"text": name, "answer_start": 0}], "is_impossible": False},
            {"id": f"n{seed}-{number}", "question": "Who read it?", "answers": [],
             "is_impossible": True}]})
    path.write_text(json.dumps({"version": "v2.0",
                                "data": [{"title": "t", "paragraphs": paragraphs}]}))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The directory the pages' commands run in, with the inputs they name."""
    import zstandard

    root = tmp_path_factory.mktemp("docs")
    for name in ("train_hvd.py", "train_mirrored.py", "finetune_hvd.py",
                 "finetune_mirrored.py", ".venv", "deploy"):
        (root / name).symlink_to(REPO / name)
    (root / "corpus").mkdir()
    pattern_corpus(root / "corpus" / "patterns.txt")
    documents = (root / "corpus" / "patterns.txt").read_text().split("\n\n")
    (root / "corpus" / "patterns.jsonl").write_text(
        "".join(json.dumps({"text": document}) + "\n" for document in documents if document))
    # Prompt/completion pairs in the quick start's vocabulary: a document's
    # first words and the words after them.
    (root / "examples.jsonl").write_text("".join(
        json.dumps({"prompt": " ".join(words[:3]), "completion": " ".join(words[3:7])}) + "\n"
        for words in (document.split() for document in documents) if len(words) > 3))
    repeated_letter_corpus(root / "corpus" / "letters.txt")
    (root / "pile" / "train").mkdir(parents=True)
    (root / "pile" / "train" / "00.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (root / "corpus" / "patterns.jsonl").read_bytes()))
    (root / "more").mkdir()
    pattern_corpus(root / "more" / "more.txt", documents=100, seed=1)
    (root / "SST-2").mkdir()
    rng = random.Random(0)
    for split, rows in (("train", 32), ("dev", 8)):
        lines = ["sentence\tlabel"]
        for _ in range(rows):
            label = rng.randint(0, 1)
            lines.append(f"{rng.choice(['a', 'b', 'c'])} is {['bad', 'good'][label]}\t{label}")
        (root / "SST-2" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    _squad(root / "train-v2.0.json", 0)
    _squad(root / "dev-v2.0.json", 1)
    _gpt2_directory(root / "path" / "to" / "gpt2")
    _llama_directory(root / "path" / "to" / "Llama-3.2-1B")
    # What `make demo` leaves, and the TFDS block's output: the quick start's
    # data and run, and training.md's encoder data, once those exist.
    for alias, target in (("data/demo", "mine"), ("runs/demo", "mine"),
                          ("data/wiki-bert", "enc")):
        (root / alias).parent.mkdir(exist_ok=True)
        (root / alias).symlink_to(target)
    return root


def _environment():
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.path.dirname(sys.executable)}" \
                  f"{os.pathsep}{env.get('PATH', '')}"
    return env


_DONE = {}


def test_every_block_runs_or_says_why_not():
    # A block that runs holds only front-end commands; a marker gives a reason.
    assert len(EXAMPLES) >= 20 and sum(reason is None for *_, reason in EXAMPLES) >= 12
    for where, language, text, reason in EXAMPLES:
        if reason is not None:
            assert len(reason) > 10, f"{where}: say why it is not run"
        elif language == "bash":
            for words in commands(text):
                assert front_end(words), (
                    f"{where}: `{' '.join(words)}` is not a tfgpt front end; "
                    "mark the block with <!-- not run: REASON -->")


@pytest.mark.parametrize("where, language, text, reason", EXAMPLES,
                         ids=[where for where, *_ in EXAMPLES])
def test_each_example_runs(where, language, text, reason, workdir):
    if reason is not None:
        pytest.skip(f"{where} not run: {reason}")
    runs = ([tiny(words) for words in commands(text)] if language == "bash"
            else [[sys.executable, "-c", re.sub(
                rf"\b({'|'.join(TINY_KEYWORDS)})=\d+",
                lambda match: f"{match.group(1)}={TINY_KEYWORDS[match.group(1)]}", text)]])
    for words in runs:
        key = tuple(words)
        if key in _DONE:  # the same command on an earlier page: its output is there
            continue
        result = subprocess.run(words, cwd=workdir, env=_environment(), capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, (
            f"{where}: {shlex.join(words)} exited {result.returncode}\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        _DONE[key] = where
