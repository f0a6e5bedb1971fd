"""NumPy reference implementation of the BERT/ALBERT encoders, written from the papers.

Shared by tests/test_bert.py and tests/test_albert.py. Every function reads
the weights of a tfgpt layer and recomputes its output head by head, with
nothing but NumPy, so a wrong transpose, a dropped bias or a misplaced norm
shows as a mismatch.
"""

import math

import numpy as np
from numpy.testing import assert_allclose

_erf = np.vectorize(math.erf)


def randomize(model, seed=0, scale=0.2):
    """Adds noise to every weight, so that unit norms and zero biases can't hide bugs."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(weight.numpy() + rng.normal(0, scale, weight.shape))


def layer_norm(x, layer):
    mean = x.mean(-1, keepdims=True)
    variance = x.var(-1, keepdims=True)
    normed = (x - mean) / np.sqrt(variance + layer.epsilon)
    return normed * layer.gamma.numpy() + layer.beta.numpy()


def dense(x, layer):
    return x @ layer.kernel.numpy() + layer.bias.numpy()


def activation(name, x):
    if name == "gelu":
        return 0.5 * x * (1 + _erf(x / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return np.maximum(x, 0)


def softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def attention(x, layer, padding_mask=None):
    """Bidirectional multi-head attention; padding keys get probability 0."""
    q, k, v = dense(x, layer.query), dense(x, layer.key), dense(x, layer.value)
    head_dim = layer.hidden_dim // layer.num_heads
    heads = []
    for h in range(layer.num_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        scores = q[..., cols] @ np.swapaxes(k[..., cols], -1, -2) / np.sqrt(head_dim)  # (B, T, T)
        if padding_mask is not None:
            scores = np.where(padding_mask[:, None, :].astype(bool), scores, -np.inf)
        heads.append(softmax(scores) @ v[..., cols])
    return dense(np.concatenate(heads, -1), layer.output_projection)


def block(x, layer, padding_mask=None):
    def feedforward(y):
        hidden = activation(layer.activation, dense(y, layer.feedforward_intermediate))
        return dense(hidden, layer.feedforward_output)

    if layer.norm_first:
        x = x + attention(layer_norm(x, layer.attention_norm), layer.attention, padding_mask)
        return x + feedforward(layer_norm(x, layer.feedforward_norm))
    x = layer_norm(x + attention(x, layer.attention, padding_mask), layer.attention_norm)
    return layer_norm(x + feedforward(x), layer.feedforward_norm)


def embeddings(token_ids, segment_ids, layer):
    token = layer.token_embedding.embeddings.numpy()[token_ids]
    position = layer.position_embedding.embeddings.numpy()[: token_ids.shape[1]]
    segment = layer.segment_embedding.embeddings.numpy()[segment_ids]
    return layer_norm(token + position + segment, layer.embedding_norm)


def bert_backbone(token_ids, segment_ids, padding_mask, backbone):
    x = embeddings(token_ids, segment_ids, backbone.embeddings)
    for layer in backbone.blocks:
        x = block(x, layer, padding_mask)
    if backbone.norm_first:
        x = layer_norm(x, backbone.final_norm)
    return x, np.tanh(dense(x[:, 0], backbone.pooler))


def albert_backbone(token_ids, segment_ids, padding_mask, backbone):
    x = embeddings(token_ids, segment_ids, backbone.embeddings)  # (B, T, E)
    x = dense(x, backbone.embedding_projection)  # (B, T, H)
    layers_per_group = backbone.num_layers // backbone.num_groups
    for index in range(backbone.num_layers):
        x = block(x, backbone.blocks[index // layers_per_group], padding_mask)
    if backbone.norm_first:
        x = layer_norm(x, backbone.final_norm)
    return x, np.tanh(dense(x[:, 0], backbone.pooler))


def masked_lm(x, head, token_embedding):
    x = layer_norm(activation(head.activation, dense(x, head.transform)), head.transform_norm)
    return x @ token_embedding.T + head.output_bias.numpy()


def classifier(pooled, head):
    return dense(pooled, head.classifier)


def check_pretraining_model(model, inputs, backbone_reference):
    """Asserts that a `Bert` or `Albert` computes what the reference does.

    `backbone_reference` is `bert_backbone` or `albert_backbone`. Sequence,
    pooled and sentence-pair outputs within 1e-4, masked-LM logits (a sum
    over the embedding width) within 1e-3.
    """
    outputs = model(inputs)
    sequence, pooled = backbone_reference(
        inputs["token_ids"], inputs["segment_ids"], inputs["padding_mask"], model.backbone
    )
    table = model.backbone.token_embedding.numpy()
    assert_allclose(outputs["sequence_output"].numpy(), sequence, atol=1e-4)
    assert_allclose(outputs["pooled_output"].numpy(), pooled, atol=1e-4)
    assert_allclose(
        outputs["mlm_logits"].numpy(), masked_lm(sequence, model.masked_lm_head, table), atol=1e-3
    )
    pair_head = getattr(model, model.pair_head_name)
    assert_allclose(
        outputs[f"{model.pair_task}_logits"].numpy(), classifier(pooled, pair_head), atol=1e-4
    )


def check_layer(layer, reference, padding_mask, seed, atol):
    """Asserts that `layer` computes `reference(x, layer, padding_mask)`.

    `x` is normal (B, T, C) noise drawn with `seed`, for the (B, T)
    `padding_mask`; the layer's weights get noise drawn with `seed + 1`.
    """
    batch, length = padding_mask.shape
    x = np.random.default_rng(seed).normal(size=(batch, length, layer.hidden_dim))
    x = x.astype("float32")
    layer(x)
    randomize(layer, seed=seed + 1)
    assert_allclose(
        layer(x, padding_mask=padding_mask).numpy(), reference(x, layer, padding_mask), atol=atol
    )
