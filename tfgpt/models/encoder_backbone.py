"""What the BERT, ALBERT and RoBERTa backbones share: embeddings, blocks and a pooler."""

import keras

from tfgpt.layers.encoder_embedding import EncoderEmbedding
from tfgpt.models.block_stack import BlockStack
from tfgpt.models.configured_model import ConfiguredModel
from tfgpt.models.encoder_inputs import unpack_encoder_inputs


class EncoderBackbone(BlockStack, ConfiguredModel):
    """A bidirectional transformer encoder: BERT's, and ALBERT's and RoBERTa's as changes.

    Token, position and segment embeddings summed and layer-normalised,
    bidirectional `TransformerBlock`s (post-LN; pre-LN plus a final layer
    norm with `norm_first=True`), and a pooler `tanh(dense(h[:, 0]))` on the
    first ([CLS]) token (Devlin et al. 2019). ALBERT's two changes (Lan et
    al. 2020) come with its config's two extra fields: `embedding_dim`
    (embeddings of width E, projected to H by `embedding_projection`) and
    `num_groups` (that many blocks hold parameters; layer i applies
    `block_for_layer(i)`). RoBERTa's one change (Liu et al. 2019) comes with
    its config's `pad_id`: positions that skip the pad tokens
    (`EncoderEmbedding`).

    Inputs: a dict with `token_ids` (B, T) and optionally `segment_ids`
    (B, T) and `padding_mask` (B, T, true at real tokens), or a bare
    `token_ids` tensor. Outputs: a dict with `sequence_output` (B, T, H)
    and `pooled_output` (B, H).
    """

    @property
    def projects_embeddings(self):
        """Whether the config has an `embedding_dim` (ALBERT's E) to project from."""
        return hasattr(self.config, "embedding_dim")

    @property
    def embedding_width(self):
        """Width of the embeddings: the config's `embedding_dim`, else `hidden_dim`."""
        return getattr(self.config, "embedding_dim", self.hidden_dim)

    @property
    def pad_id(self):
        """The pad id that positions skip: the config's `pad_id` (RoBERTa), else None."""
        return getattr(self.config, "pad_id", None)

    @property
    def num_blocks(self):
        """Blocks that hold parameters: the config's `num_groups`, else one per layer."""
        return getattr(self.config, "num_groups", self.num_layers)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        # The projection's and the pooler's initializer. Created before the
        # embeddings' when there is a projection, after the blocks' when not:
        # an unseeded initializer draws its seed when created, and this order
        # keeps the initial weights a given seed has always given.
        initializer = (
            keras.initializers.RandomNormal(stddev=0.02) if self.projects_embeddings else None
        )
        self.embeddings = EncoderEmbedding(
            self.vocabulary_size,
            self.max_sequence_length,
            self.num_segments,
            self.embedding_width,
            dropout=self.dropout,
            layer_norm_epsilon=self.layer_norm_epsilon,
            pad_id=self.pad_id,
            dtype=policy,
            name="embeddings",
        )
        # ALBERT's factorised embeddings: E -> H by one dense layer.
        self.embedding_projection = (
            keras.layers.Dense(
                self.hidden_dim,
                kernel_initializer=initializer,
                dtype=policy,
                name="embedding_projection",
            )
            if self.projects_embeddings
            else None
        )
        self._add_blocks(self.num_blocks, attention="bidirectional")
        self.pooler = keras.layers.Dense(
            self.hidden_dim,
            activation="tanh",
            kernel_initializer=initializer or keras.initializers.RandomNormal(stddev=0.02),
            dtype=policy,
            name="pooler",
        )
        self.build((None, None))

    def build(self, input_shape):
        # `input_shape` is the token ids' (B, T); a dict of shapes when Keras
        # rebuilds from a saved build config.
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        self.embeddings.build(input_shape)
        if self.embedding_projection is not None:
            self.embedding_projection.build(tuple(input_shape) + (self.embedding_width,))
        self._build_blocks(tuple(input_shape) + (self.hidden_dim,))
        self.pooler.build((input_shape[0], self.hidden_dim))
        self.built = True

    def block_for_layer(self, layer_index):
        """The block that layer `layer_index` applies: consecutive runs of
        `num_layers // num_blocks` layers share one."""
        return self.blocks[layer_index * len(self.blocks) // self.num_layers]

    def call(self, inputs, training=None):
        """Returns `{"sequence_output": (B, T, H), "pooled_output": (B, H)}`."""
        token_ids, segment_ids, padding_mask, _ = unpack_encoder_inputs(inputs)
        x = self.embeddings(token_ids, segment_ids, training=training)  # (B, T, E)
        if self.embedding_projection is not None:
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
