"""Low-rank adapters (tfgpt.models.adapters): the NumPy formula, the base model
untouched, only the adapters trained, and the merged model equal to the adapted one."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests import model_contract as contract
from tfgpt import GPT
from tfgpt.layers.activated_dense import ActivatedDense
from tfgpt.models.adapters import TARGETS, adapter_variables, add_adapters, merged

RANK, ALPHA = 3, 6.0


def tiny(**overrides):
    return GPT(**contract.tiny_fields(**overrides))


def ids(seed=0, batch=2, length=5):
    return np.random.default_rng(seed).integers(0, contract.VOCAB, (batch, length)).astype("int32")


def train_adapters(model, steps=4, seed=0):
    """A few AdamW steps on the next-token loss of random ids; returns the optimizer."""
    optimizer = tf.keras.optimizers.AdamW(learning_rate=0.05)
    optimizer.build(model.trainable_variables)
    for step in range(steps):
        batch = ids(seed + step, length=6)
        with tf.GradientTape() as tape:
            logits = model(batch[:, :-1], training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                batch[:, 1:], logits, from_logits=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return optimizer


def test_one_adapted_projection_follows_the_formula():
    # Oracle: x W + (alpha / r) x A B + b in NumPy, A and B set to random values.
    layer = ActivatedDense(7, activation="relu")
    layer.build((None, 5))
    layer.enable_adapter(RANK, ALPHA)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, RANK)), rng.normal(size=(RANK, 7))
    layer.adapter_a.assign(a)
    layer.adapter_b.assign(b)
    layer.bias.assign(rng.normal(size=7))
    x = rng.normal(size=(2, 4, 5)).astype("float32")
    expected = np.maximum(x @ layer.kernel.numpy() + ALPHA / RANK * (x @ a @ b)
                          + layer.bias.numpy(), 0)
    np.testing.assert_allclose(layer(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    assert not layer.kernel.trainable and not layer.bias.trainable
    assert [v.path.rsplit("/", 1)[-1] for v in layer.trainable_variables] == [
        "adapter_a", "adapter_b"]


@pytest.mark.parametrize("fields, targets, expected", [
    ({}, ("query_key_value", "output_projection"), {"query_key_value", "output_projection"}),
    # Llama-shaped: grouped-query attention has no fused projection.
    ({"feedforward": "gated", "activation": "silu", "norm": "rms", "positions": "rotary",
      "num_key_value_heads": 1, "tie_embeddings": False}, TARGETS,
     {"query", "key_value", "output_projection", "feedforward_gate",
      "feedforward_intermediate", "feedforward_output"}),
])
def test_adapters_start_at_the_base_model_and_only_they_train(fields, targets, expected):
    model = tiny(**fields)
    batch = ids()
    before = model(batch).numpy()
    base = {v.path: v.numpy() for v in model.variables}
    adapted = add_adapters(model, RANK, ALPHA, targets=targets)
    names = {layer.name for layer in adapted}
    assert names == expected
    assert len(adapted) == contract.LAYERS * len(names)
    # At initialisation B is zero: the very same logits.
    np.testing.assert_array_equal(model(batch).numpy(), before)
    assert model.trainable_variables == adapter_variables(model)
    assert len(model.trainable_variables) == 2 * len(adapted)

    optimizer = train_adapters(model)
    # Frozen: every base weight bit for bit; optimizer moments only for the adapters.
    for variable in model.variables:
        if variable.path in base and "seed_generator" not in variable.path:
            np.testing.assert_array_equal(variable.numpy(), base[variable.path], variable.path)
    moments = [v for v in optimizer.variables if v.shape.rank]
    assert len(moments) == 2 * len(model.trainable_variables)
    assert sum(int(np.prod(v.shape)) for v in moments) == 2 * sum(
        int(np.prod(v.shape)) for v in adapter_variables(model))
    assert not np.array_equal(model(batch).numpy(), before)  # B moved

    # Merged: a plain model (no adapters) with the same logits.
    plain = merged(model)
    assert not adapter_variables(plain)
    np.testing.assert_allclose(plain(batch).numpy(), model(batch).numpy(), atol=1e-5)


def test_adapter_dropout_acts_in_training_only():
    model = tiny(dropout=0.0)
    add_adapters(model, RANK, ALPHA, dropout=0.5)
    train_adapters(model, steps=2)
    batch = ids()
    plain = merged(model)
    np.testing.assert_allclose(plain(batch).numpy(), model(batch, training=False).numpy(),
                               atol=1e-5)
    assert not np.allclose(model(batch, training=True).numpy(),
                           model(batch, training=False).numpy(), atol=1e-4)


HAS = ("feedforward_intermediate, feedforward_output, output_projection, "
       "query_key_value$")


@pytest.mark.parametrize("targets, message", [
    (("c_attn",), "no projection is named 'c_attn': adapter targets are query_key_value, "
     ".*; this model has " + HAS),
    (("feedforward_gate",), "the adapter target 'feedforward_gate' names no projection of this "
     "model, which has " + HAS),
    # One of several that names nothing (the MLP is not gated) is refused too.
    (("query_key_value", "feedforward_gate"), "target 'feedforward_gate' names no projection"),
    ((), "target '' names no projection"),
])
def test_a_target_that_names_no_layer_is_one_line(targets, message):
    with pytest.raises(ValueError, match=message) as raised:
        add_adapters(tiny(), RANK, ALPHA, targets=targets)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("fields, expected", [
    ({}, {"query_key_value"}), ({"num_key_value_heads": 1}, {"query", "key_value"})])
def test_targets_naming_both_attention_inputs_take_the_models_form(fields, expected):
    targets = ("query_key_value", "query", "key_value")
    assert {layer.name for layer in add_adapters(tiny(**fields), RANK, ALPHA,
                                                 targets=targets)} == expected
    # One form alone must be the model's.
    with pytest.raises(ValueError, match="the adapter target '(query|key_value|query_key_value)"
                       "' names no projection of this model, which has"):
        add_adapters(tiny(**fields), RANK, ALPHA,
                     targets=("query", "key_value") if "query_key_value" in expected
                     else ("query_key_value",))


def test_bad_adapter_settings_are_refused():
    layer = ActivatedDense(4)
    layer.build((None, 3))
    with pytest.raises(ValueError, match="rank >= 1, alpha > 0 and dropout in"):
        layer.enable_adapter(0, ALPHA)
    layer.enable_adapter(RANK, ALPHA)
    with pytest.raises(ValueError, match="has an adapter already"):
        layer.enable_adapter(RANK, ALPHA)


def test_a_gpt2_adapter_runs_peft_export_and_merged_export_give_its_logits(tmp_path, tiny_data,
                                                                          capsys):
    # Oracles: PEFT's LoRA on transformers' GPT-2 (the run's adapters as `python -m
    # tfgpt.convert to-peft` writes them), and transformers' GPT-2 with the merged
    # weights (`to-gpt2` of the run).
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.test_instruction_data import _train
    from tfgpt import convert
    from tfgpt.loading import load_model, save_model

    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=304, n_positions=16, n_embd=24, n_layer=2, n_head=4)).eval()
    reference.save_pretrained(tmp_path / "base")
    model, _ = convert.load_gpt2_checkpoint(str(tmp_path / "base"), load_tokenizer=False)
    save_model(str(tmp_path / "init"), model)  # the base as a tfgpt run, for --init
    run = tmp_path / "run"
    _train(["--data", str(tiny_data), "--out", str(run), "--init", str(tmp_path / "init"),
            "--steps", "3", "--batch-size", "4", "--learning-rate", "0.05", "--warmup-steps", "0",
            "--eval-batches", "0", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
            "--lora-targets", "query_key_value,output_projection,feedforward_intermediate"])
    adapter = tmp_path / "adapter"
    capsys.readouterr()  # the training's lines
    assert convert.main(["to-peft", str(run), str(adapter), "--base-model",
                         str(tmp_path / "base")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {adapter} (")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base") and config["r"] == RANK

    batch = ids(length=7)
    ours = load_model(str(run), merge_adapters=False)[0](batch).numpy()
    assert np.abs(ours - model(batch).numpy()).max() > 1e-3  # the adapters trained
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, adapter).eval()
        peft_logits = adapted(torch.tensor(batch, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(peft_logits, ours, rtol=0, atol=1e-5)

    assert convert.main(["to-gpt2", str(run), str(tmp_path / "merged")]) == 0
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        merged_logits = plain(torch.tensor(batch, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(merged_logits, ours, rtol=0, atol=1e-5)

    # A model type whose switches the run's model lacks: one line naming the switch.
    capsys.readouterr()
    assert convert.main(["to-peft", str(run), str(tmp_path / "llama"), "--model-type",
                         "llama"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m tfgpt.convert to-peft: error: A llama checkpoint is an "
                            "RMSNorm, ") and error.count("\n") == 1, error
    assert not (tmp_path / "llama").exists()


def _run_directory(directory, train=None, model_type=None):
    """A directory with a run's config.json (`train`: its train record) or,
    given `model_type`, a transformers config.json."""
    directory.mkdir()
    record = {"model_type": model_type} if model_type else {"model": {}, "train": train or {}}
    (directory / "config.json").write_text(json.dumps(record))
    return str(directory)


# case: the one line it gets.
TO_PEFT_ERRORS = {
    "plain run": "{run} trained no adapters (no --lora-rank in its config.json): nothing to "
                 "write; to-gpt2 writes a run's weights",
    "no model type": "to-peft needs the base's transformers model type: give --model-type, or "
                     "--base-model a transformers directory. Received: base_model=''",
    "hub name": "to-peft needs the base's transformers model type: give --model-type, or "
                "--base-model a transformers directory. Received: base_model='gpt2'",
    "an encoder base": "{base}/config.json: model_type 'bert' is not a decoder tfgpt reads; it "
                       "reads gpt2, llama, mistral, qwen2, gptj, gpt_neo, gpt_neox",
    "an unknown type": "`model_type` must be one of ('gpt2', 'llama', 'mistral', 'qwen2', "
                       "'gptj', 'gpt_neo', 'gpt_neox'). Received: model_type='gpt3'",
}


@pytest.mark.parametrize("case", TO_PEFT_ERRORS)
def test_to_peft_refuses_in_one_line(tmp_path, capsys, case):
    from tfgpt import convert

    run = _run_directory(tmp_path / "run", {"lora_rank": 0 if case == "plain run" else 2})
    base = {"hub name": "gpt2", "an encoder base": _run_directory(tmp_path / "bert",
                                                                   model_type="bert")}.get(case)
    flags = (["--base-model", base] if base else []) + (
        ["--model-type", "gpt3"] if case == "an unknown type" else [])
    assert convert.main(["to-peft", run, str(tmp_path / "out"), *flags]) == 2
    error = capsys.readouterr().err
    assert error == (f"python -m tfgpt.convert to-peft: error: "
                     f"{TO_PEFT_ERRORS[case].format(run=run, base=base)}\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["llama-gqa", "neox-parallel", "gptj-partial-interleaved",
                                  "neo-local-every-second", "qwen2-biases"])
def test_decoder_adapters_load_in_peft_and_the_merged_model_in_transformers(case, tmp_path):
    # Oracles as for GPT-2 above; fused projections (GPT-J's and GPT-Neo's q/k/v,
    # GPT-NeoX's per-head layout, Llama's key/value) become one PEFT adapter each.
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.test_hf_decoders import _reference, _torch_logits
    from tfgpt.convert_decoders import load_hf_decoder, save_hf_adapter, save_hf_decoder

    _reference(case, tmp_path / "base")
    model_type = json.loads((tmp_path / "base" / "config.json").read_text())["model_type"]
    model = load_hf_decoder(str(tmp_path / "base"))
    names = {layer.name for layer in model.sublayers()}  # every projection the model has
    add_adapters(model, RANK, ALPHA, targets=tuple(t for t in TARGETS if t in names))
    train_adapters(model, steps=3)
    batch = ids(length=7) % 97
    ours = model(batch).numpy()

    save_hf_adapter(model, str(tmp_path / "adapter"), model_type, str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", attn_implementation="eager").eval()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(adapted, batch), ours, atol=1e-5)

    save_hf_decoder(merged(model), str(tmp_path / "merged"), model_type)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager").eval()
    np.testing.assert_allclose(_torch_logits(plain, batch), ours, atol=1e-5)
