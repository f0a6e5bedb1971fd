"""BERT: a bidirectional transformer encoder, and its pretraining heads."""

import dataclasses

import keras

from tfgpt.config import BertConfig, validate_bert_config
from tfgpt.layers.classification_head import ClassificationHead
from tfgpt.layers.encoder_block import EncoderBlock
from tfgpt.layers.encoder_embedding import EncoderEmbedding
from tfgpt.layers.layer_norm import LayerNorm
from tfgpt.layers.masked_lm_head import MaskedLMHead
from tfgpt.models.encoder_inputs import pack_encoder_inputs, unpack_encoder_inputs
from tfgpt.models.tracked_blocks import TrackedBlocks


@keras.saving.register_keras_serializable(package="tfgpt")
class BertBackbone(TrackedBlocks, keras.Model):
    """BERT encoder: embeddings, `num_layers` encoder blocks and a pooler.

    Token, position and segment embeddings summed and layer-normalised,
    post-LN encoder blocks (pre-LN plus a final layer norm with
    `norm_first=True`), and a pooler `tanh(dense(h[:, 0]))` on the first
    ([CLS]) token (Devlin et al. 2019). Heads are added by `Bert`
    (pretraining), `SequenceClassifier` and `SpanQuestionAnswerer`.

    Args:
        vocabulary_size: int. Number of token ids.
        num_layers: int. Number of encoder blocks.
        num_heads: int. Attention heads; must divide `hidden_dim`.
        hidden_dim: int. Width of the embeddings and the residual stream.
        intermediate_dim: int. Width of the feed-forward hidden layer.
        max_sequence_length: int. Longest input (rows of the position table).
        num_segments: int. Number of segment ids (2 for sentence pairs).
        dropout: float. Dropout rate, in [0, 1).
        activation: str. `"gelu"` (BERT), `"gelu_tanh"` or `"relu"`.
        norm_first: bool. Pre-LN when True, post-LN (BERT) when False.
        layer_norm_epsilon: float. Epsilon of every layer norm.

    Inputs: a dict with `token_ids` (B, T) and optionally `segment_ids`
    (B, T) and `padding_mask` (B, T, true at real tokens), or a bare
    `token_ids` tensor. Outputs: a dict with `sequence_output` (B, T, C)
    and `pooled_output` (B, C).

    Example:
    >>> backbone = BertBackbone.from_preset("bert-demo", num_layers=2)
    >>> outputs = backbone({"token_ids": tf.constant([[1, 5, 2, 0]]),
    ...                     "padding_mask": tf.constant([[1, 1, 1, 0]])})
    >>> outputs["sequence_output"].shape, outputs["pooled_output"].shape
    (TensorShape([1, 4, 192]), TensorShape([1, 192]))
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        max_sequence_length,
        num_segments=2,
        dropout=0.1,
        activation="gelu",
        norm_first=False,
        layer_norm_epsilon=1e-12,
        **kwargs,
    ):
        super().__init__(**kwargs)
        validate_bert_config(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            max_sequence_length=max_sequence_length,
            num_segments=num_segments,
            dropout=dropout,
            activation=activation,
            norm_first=norm_first,
            layer_norm_epsilon=layer_norm_epsilon,
        )
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.max_sequence_length = max_sequence_length
        self.num_segments = num_segments
        self.dropout = dropout
        self.activation = activation
        self.norm_first = norm_first
        self.layer_norm_epsilon = layer_norm_epsilon

        policy = self.dtype_policy
        self.embeddings = EncoderEmbedding(
            vocabulary_size,
            max_sequence_length,
            num_segments,
            hidden_dim,
            dropout=dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=policy,
            name="embeddings",
        )
        self.blocks = [
            EncoderBlock(
                hidden_dim,
                num_heads,
                intermediate_dim,
                dropout=dropout,
                activation=activation,
                norm_first=norm_first,
                layer_norm_epsilon=layer_norm_epsilon,
                dtype=policy,
                name=f"block_{index}",
            )
            for index in range(num_layers)
        ]
        # Post-LN blocks already end in a norm; pre-LN needs one after the last.
        self.final_norm = (
            LayerNorm(
                epsilon=layer_norm_epsilon, dtype=policy, name="final_norm"
            )
            if norm_first
            else None
        )
        self.pooler = keras.layers.Dense(
            hidden_dim,
            activation="tanh",
            kernel_initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype=policy,
            name="pooler",
        )
        self.build((None, None))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Builds the named preset (see `tfgpt.config.BERT_PRESETS`)."""
        return cls(**dataclasses.asdict(BertConfig.from_preset(name, **overrides)))

    def build(self, input_shape):
        # `input_shape` is the token ids' (B, T); a dict of shapes when Keras
        # rebuilds from a saved build config.
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        hidden_shape = tuple(input_shape) + (self.hidden_dim,)
        self.embeddings.build(input_shape)
        for block in self.blocks:
            block.build(hidden_shape)
        if self.final_norm is not None:
            self.final_norm.build(hidden_shape)
        self.pooler.build((input_shape[0], self.hidden_dim))
        self.built = True

    def call(self, inputs, training=None):
        """Returns `{"sequence_output": (B, T, C), "pooled_output": (B, C)}`."""
        token_ids, segment_ids, padding_mask, _ = unpack_encoder_inputs(inputs)
        x = self.embeddings(token_ids, segment_ids, training=training)  # (B, T, C)
        for block in self.blocks:
            x = block(x, padding_mask=padding_mask, training=training)
        if self.final_norm is not None:
            x = self.final_norm(x)
        pooled = self.pooler(x[:, 0])  # (B, C)
        return {"sequence_output": x, "pooled_output": pooled}

    @property
    def token_embedding(self):
        """The (V, C) token embedding matrix, tied to the masked-LM output."""
        return self.embeddings.token_embedding.embeddings

    def get_config(self):
        config = super().get_config()
        config.update(
            vocabulary_size=self.vocabulary_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            max_sequence_length=self.max_sequence_length,
            num_segments=self.num_segments,
            dropout=self.dropout,
            activation=self.activation,
            norm_first=self.norm_first,
            layer_norm_epsilon=self.layer_norm_epsilon,
        )
        return config


@keras.saving.register_keras_serializable(package="tfgpt")
class Bert(keras.Model):
    """BERT with its pretraining heads: masked LM and next-sentence prediction.

    A `BertBackbone` (attribute `backbone`), a `MaskedLMHead` tied to the
    token embedding, and a two-class `ClassificationHead` on the pooled
    output for next-sentence prediction (Devlin et al. 2019). The
    constructor takes exactly the `BertConfig` fields.

    Inputs: the backbone's dict plus optionally `mask_positions` (B, P), the
    positions whose original token the masked LM predicts; without it the
    masked LM scores every position. Outputs: a dict with the backbone's
    `sequence_output` and `pooled_output`, `mlm_logits` (B, P, V) and
    `nsp_logits` (B, 2), logits in float32. Class 1 of `nsp_logits` means
    "the second segment is a random sentence" (transformers' convention).

    Args:
        Exactly those of `BertBackbone`.

    Example:
    >>> model = Bert.from_preset("bert-demo", num_layers=2)
    >>> outputs = model({"token_ids": tf.constant([[1, 4, 3, 2]]),
    ...                  "mask_positions": tf.constant([[2]])})
    >>> outputs["mlm_logits"].shape, outputs["nsp_logits"].shape
    (TensorShape([1, 1, 2000]), TensorShape([1, 2]))
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        max_sequence_length,
        num_segments=2,
        dropout=0.1,
        activation="gelu",
        norm_first=False,
        layer_norm_epsilon=1e-12,
        **kwargs,
    ):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        self.backbone = BertBackbone(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            max_sequence_length=max_sequence_length,
            num_segments=num_segments,
            dropout=dropout,
            activation=activation,
            norm_first=norm_first,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=policy,
            name="backbone",
        )
        self.masked_lm_head = MaskedLMHead(
            vocabulary_size,
            hidden_dim,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=policy,
            name="masked_lm_head",
        )
        self.next_sentence_head = ClassificationHead(
            2, dtype=policy, name="next_sentence_head"
        )
        self.build((None, None))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Builds the named preset (see `tfgpt.config.BERT_PRESETS`)."""
        return cls(**dataclasses.asdict(BertConfig.from_preset(name, **overrides)))

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        hidden_dim = self.backbone.hidden_dim
        self.masked_lm_head.build(tuple(input_shape) + (hidden_dim,))
        self.next_sentence_head.build((input_shape[0], hidden_dim))
        self.built = True

    def call(self, inputs, training=None):
        """Returns the backbone outputs plus `mlm_logits` and `nsp_logits`."""
        token_ids, segment_ids, padding_mask, extras = unpack_encoder_inputs(
            inputs, extra_keys=("mask_positions",)
        )
        outputs = self.backbone(
            pack_encoder_inputs(token_ids, segment_ids, padding_mask), training=training
        )
        mlm_logits = self.masked_lm_head(
            outputs["sequence_output"],
            self.backbone.token_embedding,
            mask_positions=extras["mask_positions"],
        )
        nsp_logits = self.next_sentence_head(outputs["pooled_output"], training=training)
        return {**outputs, "mlm_logits": mlm_logits, "nsp_logits": nsp_logits}

    def get_config(self):
        config = super().get_config()
        backbone_config = self.backbone.get_config()
        config.update(
            {field.name: backbone_config[field.name] for field in dataclasses.fields(BertConfig)}
        )
        return config

