"""Fine-tuning: classification and SQuAD from a pretraining run, on every front end.

The encoder comes from a real tfgpt pretraining run made here (the trainer
core, 10 steps of mlm+nsp on a tiny BERT), so loading goes through the
trainer's checkpoint layout and the tokenizer it copied.
"""

import json
import random
import re
import shutil
import sys

import numpy as np
import pytest

from tests.launch import (
    REPO,
    assert_same_train_losses,
    horovodrun,
    multi_worker,
    run,
    train_losses,
)
from tests.synthetic import prepared

TINY_BERT = ["--preset", "bert-demo", "--num-layers", "2", "--hidden-dim", "32",
             "--num-heads", "2", "--intermediate-dim", "48", "--max-sequence-length", "48"]
FILLER = "the a film movie plot actors story scene music city river".split()
PLACES = "north south east west".split()
CAPITALS = "paris london rome oslo".split()


def pretraining_corpus(path, documents=300, seed=0):
    """Sentences over the words the tasks below use, so the tokenizer has them."""
    rng = random.Random(seed)
    words = FILLER + PLACES + CAPITALS + "great awful capital of is what".split()
    docs = []
    for _ in range(documents):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 9))) + "."
                     for _ in range(rng.randint(3, 5))]
        docs.append(" ".join(sentences))
    path.write_text("\n\n".join(docs) + "\n")


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory):
    """A tiny BERT pretraining run directory: config.json, ckpt-10, tokenizer.model."""
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    root = tmp_path_factory.mktemp("encoder")
    pretraining_corpus(root / "corpus.txt")
    data = prepared(root / "corpus.txt", root / "data", "--format", "encoder", "--seq-len", "32",
                    "--vocab-size", "400", "--val-fraction", "0.1")
    train_config, overrides = parse_flags([
        "--data", str(data), "--out", str(root / "run"), *TINY_BERT,
        "--steps", "10", "--batch-size", "8", "--log-every", "5", "--eval-batches", "1",
        "--peak-flops", "1e10",
    ])
    train(train_config, overrides, LocalDistribution())
    return root / "run"


def sst2_file(path, records, seed):
    """GLUE SST-2 layout; the label is which keyword the sentence holds."""
    rng = random.Random(seed)
    lines = ["sentence\tlabel"]
    for index in range(records):
        label = index % 2
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 6))]
        words.insert(rng.randint(0, len(words)), "great" if label else "awful")
        lines.append(" ".join(words) + " .\t" + str(label))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    root = tmp_path_factory.mktemp("sst2")
    return sst2_file(root / "train.tsv", 96, seed=1), sst2_file(root / "dev.tsv", 48, seed=2)


def squad_file(path, articles, seed, version):
    """Contexts of three "the capital of X is Y." facts; questions ask for one.

    v2.0 adds, per context, an unanswerable question about a place it does
    not mention.
    """
    rng = random.Random(seed)
    data = []
    for index in range(articles):
        places = rng.sample(PLACES, 3)
        capitals = [rng.choice(CAPITALS) for _ in places]
        facts = [f"the capital of {place} is {capital}."
                 for place, capital in zip(places, capitals)]
        context = " ".join(facts)
        asked = rng.randrange(3)
        start = context.index(facts[asked]) + len(facts[asked]) - len(capitals[asked]) - 1
        qas = [{"id": f"q{index}", "question": f"what is the capital of {places[asked]}?",
                "answers": [{"text": capitals[asked], "answer_start": start}]}]
        if version == "v2.0":
            qas[0]["is_impossible"] = False
            missing = next(place for place in PLACES if place not in places)
            qas.append({"id": f"q{index}-none", "question": f"what is the capital of {missing}?",
                        "answers": [], "is_impossible": True})
        data.append({"title": f"t{index}", "paragraphs": [{"context": context, "qas": qas}]})
    path.write_text(json.dumps({"version": version, "data": data}))
    return path


def _finetune(argv):
    from tfgpt.finetuning import finetune, parse_flags
    from tfgpt.parallel import LocalDistribution

    config, overrides = parse_flags([str(arg) for arg in argv])
    return finetune(config, overrides, LocalDistribution())


# ---- Classification ---------------------------------------------------------


@pytest.mark.slow
def test_classification_from_a_pretraining_run_learns_the_keyword(encoder_run, sst2, tmp_path):
    train_file, dev_file = sst2
    out = tmp_path / "run"
    model, metrics = _finetune([
        "--init", encoder_run, "--train-file", train_file, "--validation-file", dev_file,
        "--out", out, "--steps", "60", "--batch-size", "16", "--learning-rate", "2e-3",
        "--weight-decay", "0", "--max-sequence-length", "24", "--log-every", "20",
    ])
    # A keyword decides the label; chance is 0.5.
    assert metrics["val_accuracy"] >= 0.9, metrics
    # The predictions file, scored here against the file's own labels.
    gold = [line.split("\t")[1] for line in dev_file.read_text().splitlines()[1:]]
    predictions = json.loads((out / "predictions.json").read_text())
    assert len(predictions) == len(gold) == 48
    assert metrics["val_accuracy"] == pytest.approx(
        np.mean([p == g for p, g in zip(predictions, gold)]))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["accuracy"] == metrics["val_accuracy"] and results["step"] == 60
    config = json.loads((out / "config.json").read_text())
    assert config["family"] == "bert" and config["labels"] == ["0", "1"]
    assert (out / "tokenizer.model").exists() and (out / "ckpt-60" / "index.json").exists()
    # The backbone came from the pretraining run: [MASK] never occurs in
    # fine-tuning, so its embedding (no gradient, no decay) is still exactly
    # the one pretraining left in the checkpoint.
    from tfgpt.finetuning import describe_init, restore_backbone
    from tfgpt.models.bert import BertBackbone

    _, _, saved = describe_init(str(encoder_run))
    pretrained = BertBackbone(**saved["model"])
    restore_backbone(pretrained, str(encoder_run))
    mask_id = 5
    np.testing.assert_array_equal(
        model.backbone.embeddings.token_embedding.embeddings.numpy()[mask_id],
        pretrained.embeddings.token_embedding.embeddings.numpy()[mask_id])


def test_labels_are_inferred_sorted_numerically_or_declared(tmp_path):
    from tfgpt.finetuning import FinetuneConfig, infer_labels

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": "t", "label": label}) + "\n"
                            for label in (10, 2, 2, 1)))
    assert infer_labels(str(path)) == ["1", "2", "10"]  # not "1", "10", "2"
    path.write_text("".join(json.dumps({"text": "t", "label": label}) + "\n"
                            for label in ("pos", "neg", "pos")))
    assert infer_labels(str(path)) == ["neg", "pos"]
    config = FinetuneConfig(train_file="x.tsv", tokenizer="t", labels="negative, positive")
    assert config.declared_labels() == ["negative", "positive"]
    with pytest.raises(ValueError, match=r"at least two distinct.*labels='pos,pos'"):
        FinetuneConfig(train_file="x.tsv", tokenizer="t", labels="pos,pos")


def test_random_init_takes_the_preset_the_model_flags_and_the_tokenizer_size(
    encoder_run, sst2, tmp_path
):
    train_file, _ = sst2
    model, metrics = _finetune([
        "--init", "", "--preset", "albert-demo", "--tokenizer", encoder_run / "tokenizer.model",
        "--num-layers", "2", "--hidden-dim", "16", "--num-heads", "2", "--embedding-dim", "8",
        "--intermediate-dim", "24", "--train-file", train_file, "--out", tmp_path,
        "--steps", "2", "--batch-size", "4", "--max-sequence-length", "16",
    ])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["family"] == "albert"
    assert saved["model"]["vocabulary_size"] == 400  # the tokenizer's, not the preset's 2000
    assert saved["model"]["embedding_dim"] == 8 and saved["model"]["max_sequence_length"] == 128
    assert "val_accuracy" not in metrics  # no validation file, no evaluation
    assert np.isfinite(metrics["loss"])


@pytest.mark.slow
def test_resuming_continues_exactly(encoder_run, sst2, tmp_path):
    """3 steps, then --resume to 6, equals 6 straight steps (constant rate, no warmup)."""
    train_file, _ = sst2
    flags = ["--init", encoder_run, "--train-file", train_file, "--batch-size", "8",
             "--learning-rate", "1e-3", "--schedule", "constant", "--warmup-fraction", "0",
             "--max-sequence-length", "16", "--log-every", "1", "--classifier-dropout", "0.1"]
    straight, _ = _finetune([*flags, "--out", tmp_path / "straight", "--steps", "6"])
    _finetune([*flags, "--out", tmp_path / "resumed", "--steps", "3"])
    with pytest.raises(ValueError, match="already holds checkpoints: pass --resume"):
        _finetune([*flags, "--out", tmp_path / "resumed", "--steps", "6"])
    resumed, _ = _finetune([*flags, "--out", tmp_path / "resumed", "--steps", "6", "--resume"])
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)
    assert train_losses(tmp_path / "resumed")[6] == pytest.approx(
        train_losses(tmp_path / "straight")[6], abs=1e-6)


# ---- SQuAD ------------------------------------------------------------------


def _recomputed_predictions(out, examples, version, config):
    """Oracle: the saved checkpoint, run here on every window, post-processed here."""
    from tfgpt.checkpoint import load_weights
    from tfgpt.finetuning.offset_tokenizer import OffsetTokenizer
    from tfgpt.finetuning.squad import postprocess_predictions, squad_features
    from tfgpt.models.bert import BertBackbone
    from tfgpt.models.span_question_answerer import SpanQuestionAnswerer

    saved = json.loads((out / "config.json").read_text())
    model = SpanQuestionAnswerer(BertBackbone(**saved["model"]))
    load_weights(str(out), model)
    features = squad_features(examples, OffsetTokenizer.load(str(out)),
                              max_sequence_length=config["max_sequence_length"],
                              stride=config["doc_stride"],
                              max_question_length=config["max_query_length"])
    outputs = model(features.inputs())
    predictions = postprocess_predictions(
        examples, features, outputs["start_logits"].numpy(), outputs["end_logits"].numpy(),
        n_best=config["n_best"], max_answer_length=config["max_answer_length"],
        allow_no_answer=version == "2.0")
    return predictions, features


@pytest.mark.slow
@pytest.mark.parametrize("version", ["1.1", "v2.0"])
def test_squad_end_to_end_scores_equal_the_official_metrics(encoder_run, tmp_path, version):
    from tfgpt.finetuning.squad import gold_answers, read_squad
    from tfgpt.finetuning.squad_metrics import squad_scores

    train_file = squad_file(tmp_path / "train.json", 40, seed=1, version=version)
    dev_file = squad_file(tmp_path / "dev.json", 12, seed=2, version=version)
    out = tmp_path / "run"
    _, metrics = _finetune([
        "--task", "squad", "--init", encoder_run, "--train-file", train_file,
        "--validation-file", dev_file, "--out", out, "--steps", "40", "--batch-size", "8",
        "--learning-rate", "2e-3", "--weight-decay", "0", "--max-sequence-length", "24",
        "--max-query-length", "10", "--doc-stride", "6", "--log-every", "10",
    ])
    losses = train_losses(out)
    assert losses[40] < losses[1]
    file_version, examples = read_squad(str(dev_file))
    predictions = json.loads((out / "predictions.json").read_text())
    assert set(predictions) == {example.question_id for example in examples}
    for example in examples:
        assert predictions[example.question_id] in example.context
    # The scores are squad_metrics' on the written predictions...
    expected = squad_scores(gold_answers(examples), predictions, version=file_version)
    results = json.loads((out / "eval_results.json").read_text())
    for name in ("exact_match", "f1", "total", "missing"):
        assert results[name] == metrics[f"val_{name}"] == expected[name], name
    assert results["version"] == file_version == version.removeprefix("v")
    # ...and the predictions are those of the saved model over every window.
    config = json.loads((out / "config.json").read_text())["finetune"]
    recomputed, features = _recomputed_predictions(out, examples, file_version, config)
    assert len(features.token_ids) > 2 * len(examples)  # long contexts: several windows each
    assert recomputed == predictions
    print(f"SQuAD {version}: {results}")


# ---- The front ends: Horovod and tf.distribute ------------------------------


def _front_end_flags(encoder_run, sst2, out, batch_size):
    train_file, dev_file = sst2
    return ["--init", encoder_run, "--train-file", train_file, "--validation-file", dev_file,
            "--out", out, "--steps", "6", "--batch-size", batch_size, "--learning-rate", "3e-3",
            "--warmup-fraction", "0", "--no-shuffle", "--classifier-dropout", "0",
            "--max-sequence-length", "16", "--log-every", "1", "--weight-decay", "0"]


@pytest.mark.distributed
def test_horovod_and_mirrored_match_one_process_and_keep_replicas_identical(
    encoder_run, sst2, tmp_path
):
    """Global batch 8: 1 process x 8, 2 Horovod ranks x 4, 2 mirrored replicas x 4."""
    _, single_metrics = _finetune(_front_end_flags(encoder_run, sst2, tmp_path / "single", 8))
    script = REPO / "tests" / "worker_scripts" / "finetune_and_dump.py"
    code, output = horovodrun(
        2, script, "hvd", tmp_path, *_front_end_flags(encoder_run, sst2, tmp_path / "hvd", 4))
    assert code == 0, output
    assert "2 worker(s), 2 replica(s)" in output
    ranks = [np.load(tmp_path / f"rank-{rank}.npz") for rank in (0, 1)]
    assert len(ranks[0].files) > 30
    for key in ranks[0].files:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)

    mirrored_dir = tmp_path / "mirrored-dump"
    mirrored_dir.mkdir()
    code, output = run([sys.executable, script, "mirrored", mirrored_dir, "--strategy", "mirrored",
                        "--logical-cpus", "2",
                        *_front_end_flags(encoder_run, sst2, tmp_path / "mirrored", 4)])
    assert code == 0, output
    assert "1 worker(s), 2 replica(s)" in output
    replicas = np.load(mirrored_dir / "rank-0.npz")
    weights = [key for key in replicas.files if key.startswith("weight_")]
    for key in weights:
        np.testing.assert_array_equal(replicas[f"replica_0_{key}"], replicas[f"replica_1_{key}"])

    # Float32 sums in another order: the losses agree to 1e-4 over 6 updates.
    assert_same_train_losses(
        tmp_path / "single", [tmp_path / "hvd", tmp_path / "mirrored"], steps=6, tolerance=1e-4)
    for name in ("hvd", "mirrored"):
        results = json.loads((tmp_path / name / "eval_results.json").read_text())
        # Each worker evaluated half of dev.tsv; together, all of it.
        assert results["total"] == 48
        assert results["accuracy"] == pytest.approx(single_metrics["val_accuracy"], abs=1 / 48)
    # The steps changed the encoder: its token embedding left the checkpoint's.
    from tfgpt.finetuning import describe_init, restore_backbone
    from tfgpt.models.bert import BertBackbone

    pretrained = BertBackbone(**describe_init(str(encoder_run))[2]["model"])
    restore_backbone(pretrained, str(encoder_run))
    start = pretrained.embeddings.token_embedding.embeddings.numpy()
    assert ranks[0]["weight_0"].shape == start.shape
    assert np.abs(ranks[0]["weight_0"] - start).max() > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
def test_two_multi_worker_mirrored_workers_split_training_and_evaluation(
    encoder_run, sst2, tmp_path
):
    """Collective checkpoints and the gathered predictions under MultiWorkerMirrored."""
    script = REPO / "tests" / "worker_scripts" / "finetune_and_dump.py"
    flags = _front_end_flags(encoder_run, sst2, tmp_path / "run", 4)
    results = multi_worker(2, script, "mirrored", tmp_path, "--strategy", "multi-worker", *flags)
    for code, output in results:
        assert code == 0, output
    outputs = [output for _, output in results]
    assert "2 worker(s), 2 replica(s)" in outputs[0]
    workers = [np.load(tmp_path / f"rank-{index}.npz") for index in (0, 1)]
    for key in workers[0].files:
        np.testing.assert_array_equal(workers[0][key], workers[1][key], err_msg=key)
    # Each worker predicted half of dev.tsv; the chief wrote all of it.
    predictions = json.loads((tmp_path / "run" / "predictions.json").read_text())
    results = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    gold = [line.split("\t")[1] for line in sst2[1].read_text().splitlines()[1:]]
    assert len(predictions) == results["total"] == 48
    assert results["correct"] == sum(p == g for p, g in zip(predictions, gold))
    assert (tmp_path / "run" / "ckpt-6" / "index.json").exists()


# ---- Bad input --------------------------------------------------------------


def test_squad_answer_not_in_its_context_is_an_error_naming_the_question(
    encoder_run, tmp_path
):
    path = squad_file(tmp_path / "train.json", 3, seed=1, version="1.1")
    data = json.loads(path.read_text())
    data["data"][1]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] += 2
    path.write_text(json.dumps(data))
    code, output = run([sys.executable, REPO / "finetune_hvd.py", "--task", "squad",
                        "--init", encoder_run, "--train-file", path, "--out", tmp_path / "run"])
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert "question 'q1'" in errors[0] and "does not match its context" in errors[0]
    assert not (tmp_path / "run").exists()  # nothing was built or written


def test_label_outside_the_declared_set_names_file_line_and_value(encoder_run, sst2, tmp_path):
    train_file, dev_file = sst2
    bad = tmp_path / "train.tsv"
    lines = train_file.read_text().splitlines()
    lines[3] = lines[3].rsplit("\t", 1)[0] + "\tpositive"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train\.tsv:4: label 'positive' is not one of the "
                                         r"declared labels \['0', '1'\]"):
        _finetune(["--init", encoder_run, "--train-file", bad, "--labels", "0,1",
                   "--out", tmp_path / "a"])
    # Labels inferred from the training file bind the validation file too.
    dev = tmp_path / "dev.tsv"
    dev.write_text(dev_file.read_text() + "a film .\t2\n")
    with pytest.raises(ValueError, match=r"dev\.tsv:50: label '2' is not one of"):
        _finetune(["--init", encoder_run, "--train-file", train_file, "--validation-file", dev,
                   "--out", tmp_path / "b"])


def _copy_run(encoder_run, target, edit):
    shutil.copytree(encoder_run, target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_init_of_the_wrong_architecture_or_family_is_named(encoder_run, sst2, tmp_path):
    train_file, _ = sst2

    def attempt(init, *extra):
        return _finetune(["--init", init, "--train-file", train_file,
                          "--out", tmp_path / "out", *extra])

    gpt = _copy_run(encoder_run, tmp_path / "gpt", lambda c: c.update(
        family="gpt", task="clm"))
    with pytest.raises(ValueError, match=rf"--init {gpt} holds a 'gpt' model; fine-tuning "
                                         "needs a BERT or ALBERT encoder"):
        attempt(gpt)
    # config.json says hidden_dim 48, the checkpoint holds 32.
    wider = _copy_run(encoder_run, tmp_path / "wider", lambda c: c["model"].update(
        hidden_dim=48))
    with pytest.raises(ValueError, match=rf"--init {wider}: ckpt-10 does not hold the "
                                         r"BertBackbone .*shape \(400, 32\).*\(400, 48\)"):
        attempt(wider)
    # A BERT checkpoint labelled ALBERT.
    albert = _copy_run(encoder_run, tmp_path / "albert", lambda c: (
        c.update(family="albert"), c["model"].update(embedding_dim=32, num_groups=1)))
    with pytest.raises(ValueError, match=rf"--init {albert}: ckpt-10 does not hold the "
                                         r"AlbertBackbone .* holds no "
                                         r"'backbone/embedding_projection/kernel'"):
        attempt(albert)
    # A model flag may not change the checkpoint's architecture.
    with pytest.raises(ValueError, match=rf"--num-layers 3 contradicts --init {encoder_run}, "
                                         "which has num_layers=2"):
        attempt(encoder_run, "--num-layers", "3")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "ner"], "argument --task: invalid choice: 'ner'"),
        (["--task", "squad", "--max-sequence-length", "32", "--max-query-length", "12",
          "--doc-stride", "20"], r"`doc_stride` must be at most .* = 17"),
        (["--init", "", "--tokenizer", "t", "--preset", "gpt-demo"],
         "must be a BERT or ALBERT preset"),
        (["--init", "", "--tokenizer", "t", "--preset", "albert-demo", "--num-segments", "0"],
         "`num_segments` must be a positive integer"),
        (["--init", "", "--tokenizer", "t", "--preset", "bert-demo", "--embedding-dim", "8"],
         "--embedding-dim is not a BertConfig field"),
        (["--init", ""], "`tokenizer` is required when `init` is empty"),
        (["--steps", "-1"], "`steps` must be a non-negative integer"),
    ],
)
def test_flag_errors_exit_before_anything_is_built(flags, message, tmp_path, capsys):
    from tfgpt.finetuning import parse_flags

    argv = ["--train-file", "train.tsv", "--init", "runs/x", "--out", str(tmp_path), *flags]
    with pytest.raises(SystemExit) as raised:
        parse_flags(argv)
    assert raised.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error: " in error and re.search(message, error), error


# ---- Tokenizers and Hugging Face directories --------------------------------


def test_offset_tokenizer_ids_equal_the_pipeline_tokenizer_and_offsets_cover_the_text(
    encoder_run, tmp_path
):
    from pipelines.tokenizer import Tokenizer
    from tfgpt.finetuning.offset_tokenizer import OffsetTokenizer

    tokenizer = OffsetTokenizer.load(str(encoder_run))
    reference = Tokenizer.load(str(encoder_run))
    text = "Héllo  the capital\tof ☃ is oslo."
    ids, offsets = tokenizer.encode_with_offsets(text)
    assert ids == reference.encode(text) == tokenizer.encode(text)
    assert (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id) == (
        reference.cls_id, reference.sep_id, reference.pad_id) == (3, 4, 0)
    # Offsets tile the text; the snowman's three byte pieces all cover it.
    assert "".join(text[start:end] for start, end in dict.fromkeys(offsets)) == text
    snowman = [offset for offset in offsets if text[offset[0]:offset[1]] == "☃"]
    assert len(snowman) == 3

    # A Hugging Face BERT vocab.txt: specials found by name, not position.
    vocabulary = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                  "hello", "den", "##ver", ",", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(vocabulary) + "\n")
    wordpiece = OffsetTokenizer.load(str(tmp_path))
    text = "Héllo Denver, ☃."
    ids, offsets = wordpiece.encode_with_offsets(text)
    assert (wordpiece.cls_id, wordpiece.sep_id, wordpiece.pad_id) == (3, 4, 0)
    assert ids == [6, 7, 8, 9, 2, 10]
    assert [text[start:end] for start, end in offsets] == ["Héllo", "Den", "ver", ",", "☃", "."]


@pytest.mark.slow
def test_classification_from_a_hugging_face_bert_directory(sst2, tmp_path):
    import torch
    import transformers

    from tfgpt.convert_encoders import load_hf_encoder
    from tfgpt.finetuning import FinetuneConfig, build_backbone

    vocabulary = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".",
                  *FILLER, "great", "awful"]
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=len(vocabulary), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32)).save_pretrained(hf_dir)
    (hf_dir / "vocab.txt").write_text("\n".join(vocabulary) + "\n")
    train_file, dev_file = sst2

    config = FinetuneConfig(init=str(hf_dir), train_file=str(train_file))
    backbone, family, _ = build_backbone(config, {}, len(vocabulary))
    reference = load_hf_encoder(str(hf_dir), head=None)
    assert family == "bert"
    for mine, theirs in zip(backbone.weights, reference.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())

    _, metrics = _finetune([
        "--init", hf_dir, "--train-file", train_file, "--validation-file", dev_file,
        "--out", tmp_path / "run", "--steps", "4", "--batch-size", "8",
        "--max-sequence-length", "16", "--dropout", "0.0",
    ])
    assert metrics["val_total"] == 48 and 0.0 <= metrics["val_accuracy"] <= 1.0
    assert (tmp_path / "run" / "vocab.txt").exists()
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["hidden_dim"] == 16 and saved["model"]["dropout"] == 0.0


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_stage_3_pretraining_and_finetuning_match_stage_0(encoder_run, sst2, tmp_path):
    """A BERT pretrained with --zero-stage 3 (weights only in shards) is the
    --init of a fine-tuning at stage 0 and at stage 3: the same losses."""
    sharded = tmp_path / "sharded-pretraining"
    code, output = horovodrun(2, REPO / "train_hvd.py", "--data", encoder_run.parent / "data",
                              "--out", sharded, *TINY_BERT, "--steps", "4", "--batch-size", "4",
                              "--log-every", "2", "--eval-batches", "1", "--peak-flops", "1e10",
                              "--zero-stage", "3")
    assert code == 0, output
    assert "validation loss" in output and (sharded / "ckpt-4" / "index.json").exists()
    for stage in ("0", "3"):
        code, output = horovodrun(2, REPO / "finetune_hvd.py", "--zero-stage", stage,
                                  *_front_end_flags(sharded, sst2, tmp_path / f"stage-{stage}", 4))
        assert code == 0, output
    assert_same_train_losses(tmp_path / "stage-0", [tmp_path / "stage-3"], steps=6,
                             tolerance=1e-5)
    results = [json.loads((tmp_path / f"stage-{stage}" / "eval_results.json").read_text())
               for stage in ("0", "3")]
    assert results[0]["total"] == results[1]["total"] == 48
    assert results[0]["accuracy"] == pytest.approx(results[1]["accuracy"], abs=1 / 48)
