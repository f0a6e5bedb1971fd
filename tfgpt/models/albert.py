"""ALBERT: BERT with factorised embeddings and cross-layer parameter sharing."""

import dataclasses

import keras

from tfgpt.config import AlbertConfig, validate_albert_config
from tfgpt.layers.classification_head import ClassificationHead
from tfgpt.layers.encoder_block import EncoderBlock
from tfgpt.layers.encoder_embedding import EncoderEmbedding
from tfgpt.layers.layer_norm import LayerNorm
from tfgpt.layers.masked_lm_head import MaskedLMHead
from tfgpt.models.encoder_inputs import pack_encoder_inputs, unpack_encoder_inputs
from tfgpt.models.tracked_blocks import TrackedBlocks


@keras.saving.register_keras_serializable(package="tfgpt")
class AlbertBackbone(TrackedBlocks, keras.Model):
    """ALBERT encoder (Lan et al. 2020): a BERT encoder with fewer parameters.

    Two changes to `BertBackbone`:
    - Factorised embedding parameterisation: token, position and segment
      embeddings have width `embedding_dim` (E, 128 in every published
      size), layer-normalised and then projected to `hidden_dim` (H) by
      one dense layer, so the vocabulary costs V*E + E*H instead of V*H.
    - Cross-layer parameter sharing: only `num_groups` encoder blocks hold
      parameters (attribute `blocks`); layer i applies
      `blocks[i // (num_layers // num_groups)]`. ALBERT uses one group, so
      every layer is the same block.

    Pre-LN (`norm_first=True`) adds a final layer norm after the last layer.
    The pooler is `tanh(dense(h[:, 0]))` on the first ([CLS]) token.

    Args:
        vocabulary_size: int. Number of token ids.
        num_layers: int. Number of layers applied in sequence.
        num_heads: int. Attention heads; must divide `hidden_dim`.
        hidden_dim: int. Width of the residual stream (H).
        intermediate_dim: int. Width of the feed-forward hidden layer.
        embedding_dim: int. Width of the embeddings (E).
        num_groups: int. Distinct parameter sets; must divide `num_layers`.
        max_sequence_length: int. Longest input (rows of the position table).
        num_segments: int. Number of segment ids (2 for sentence pairs).
        dropout: float. Dropout rate, in [0, 1).
        activation: str. `"gelu_tanh"` (ALBERT), `"gelu"` or `"relu"`.
        norm_first: bool. Pre-LN when True, post-LN (ALBERT) when False.
        layer_norm_epsilon: float. Epsilon of every layer norm.

    Inputs and outputs are those of `BertBackbone`.

    Example:
    >>> backbone = AlbertBackbone.from_preset("albert-demo", num_layers=2)
    >>> backbone(tf.constant([[1, 5, 2]]))["sequence_output"].shape
    TensorShape([1, 3, 192])
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        embedding_dim,
        num_groups=1,
        max_sequence_length=512,
        num_segments=2,
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=False,
        layer_norm_epsilon=1e-12,
        **kwargs,
    ):
        super().__init__(**kwargs)
        validate_albert_config(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            embedding_dim=embedding_dim,
            num_groups=num_groups,
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
        self.embedding_dim = embedding_dim
        self.num_groups = num_groups
        self.max_sequence_length = max_sequence_length
        self.num_segments = num_segments
        self.dropout = dropout
        self.activation = activation
        self.norm_first = norm_first
        self.layer_norm_epsilon = layer_norm_epsilon

        policy = self.dtype_policy
        initializer = keras.initializers.RandomNormal(stddev=0.02)
        self.embeddings = EncoderEmbedding(
            vocabulary_size,
            max_sequence_length,
            num_segments,
            embedding_dim,
            dropout=dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=policy,
            name="embeddings",
        )
        self.embedding_projection = keras.layers.Dense(
            hidden_dim,
            kernel_initializer=initializer,
            dtype=policy,
            name="embedding_projection",
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
            for index in range(num_groups)
        ]
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
            kernel_initializer=initializer,
            dtype=policy,
            name="pooler",
        )
        self.build((None, None))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Builds the named preset (see `tfgpt.config.ALBERT_PRESETS`)."""
        return cls(**dataclasses.asdict(AlbertConfig.from_preset(name, **overrides)))

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        hidden_shape = tuple(input_shape) + (self.hidden_dim,)
        self.embeddings.build(input_shape)
        self.embedding_projection.build(tuple(input_shape) + (self.embedding_dim,))
        for block in self.blocks:
            block.build(hidden_shape)
        if self.final_norm is not None:
            self.final_norm.build(hidden_shape)
        self.pooler.build((input_shape[0], self.hidden_dim))
        self.built = True

    def block_for_layer(self, layer_index):
        """The shared block that layer `layer_index` applies."""
        return self.blocks[layer_index // (self.num_layers // self.num_groups)]

    def call(self, inputs, training=None):
        """Returns `{"sequence_output": (B, T, H), "pooled_output": (B, H)}`."""
        token_ids, segment_ids, padding_mask, _ = unpack_encoder_inputs(inputs)
        x = self.embeddings(token_ids, segment_ids, training=training)  # (B, T, E)
        x = self.embedding_projection(x)  # (B, T, H)
        for layer_index in range(self.num_layers):
            x = self.block_for_layer(layer_index)(
                x, padding_mask=padding_mask, training=training
            )
        if self.final_norm is not None:
            x = self.final_norm(x)
        pooled = self.pooler(x[:, 0])  # (B, H)
        return {"sequence_output": x, "pooled_output": pooled}

    @property
    def token_embedding(self):
        """The (V, E) token embedding matrix, tied to the masked-LM output."""
        return self.embeddings.token_embedding.embeddings

    def get_config(self):
        config = super().get_config()
        config.update(
            vocabulary_size=self.vocabulary_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            embedding_dim=self.embedding_dim,
            num_groups=self.num_groups,
            max_sequence_length=self.max_sequence_length,
            num_segments=self.num_segments,
            dropout=self.dropout,
            activation=self.activation,
            norm_first=self.norm_first,
            layer_norm_epsilon=self.layer_norm_epsilon,
        )
        return config


@keras.saving.register_keras_serializable(package="tfgpt")
class Albert(keras.Model):
    """ALBERT with its pretraining heads: masked LM and sentence-order prediction.

    An `AlbertBackbone` (attribute `backbone`), a `MaskedLMHead` that
    transforms to width E and is tied to the E-wide token embedding, and a
    two-class `ClassificationHead` on the pooled output for sentence-order
    prediction (Lan et al. 2020, Section 3.1). The constructor takes exactly
    the `AlbertConfig` fields.

    Inputs: the backbone's dict plus optionally `mask_positions` (B, P).
    Outputs: a dict with `sequence_output`, `pooled_output`, `mlm_logits`
    (B, P, V) and `sop_logits` (B, 2), logits in float32. Class 1 of
    `sop_logits` means "the two segments are swapped" (transformers'
    `sentence_order_label` convention).

    Args:
        Exactly those of `AlbertBackbone`.

    Example:
    >>> model = Albert.from_preset("albert-demo", num_layers=2)
    >>> model({"token_ids": tf.constant([[1, 4, 3, 2]])})["sop_logits"].shape
    TensorShape([1, 2])
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        embedding_dim,
        num_groups=1,
        max_sequence_length=512,
        num_segments=2,
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=False,
        layer_norm_epsilon=1e-12,
        **kwargs,
    ):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        self.backbone = AlbertBackbone(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=intermediate_dim,
            embedding_dim=embedding_dim,
            num_groups=num_groups,
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
            embedding_dim,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=policy,
            name="masked_lm_head",
        )
        self.sentence_order_head = ClassificationHead(
            2, dropout=dropout, dtype=policy, name="sentence_order_head"
        )
        self.build((None, None))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Builds the named preset (see `tfgpt.config.ALBERT_PRESETS`)."""
        return cls(**dataclasses.asdict(AlbertConfig.from_preset(name, **overrides)))

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        hidden_dim = self.backbone.hidden_dim
        self.masked_lm_head.build(tuple(input_shape) + (hidden_dim,))
        self.sentence_order_head.build((input_shape[0], hidden_dim))
        self.built = True

    def call(self, inputs, training=None):
        """Returns the backbone outputs plus `mlm_logits` and `sop_logits`."""
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
        sop_logits = self.sentence_order_head(outputs["pooled_output"], training=training)
        return {**outputs, "mlm_logits": mlm_logits, "sop_logits": sop_logits}

    def get_config(self):
        config = super().get_config()
        backbone_config = self.backbone.get_config()
        config.update(
            {field.name: backbone_config[field.name] for field in dataclasses.fields(AlbertConfig)}
        )
        return config
