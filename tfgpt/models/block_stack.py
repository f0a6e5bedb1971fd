"""The stack of transformer blocks that GPT and the encoder backbones share."""

from tfgpt.layers.layer_norm import LayerNorm
from tfgpt.layers.rms_norm import RMSNorm
from tfgpt.layers.transformer_block import TransformerBlock


class BlockStack:
    """Mixin for a `ConfiguredModel` whose blocks are `TransformerBlock`s.

    `_add_blocks` creates the blocks, of the config's shape, as `blocks`
    (named `block_0`, `block_1`, ...) and the final layer norm a pre-LN
    stack ends with as `final_norm` (None for post-LN, whose blocks
    already end in a norm); `_build_blocks` builds them.

    Keras 3 (3.15) hands a list attribute of layers to SavedModel but not to
    `tf.train.Checkpoint`: `Checkpoint(model=model)` would save and restore
    everything but the blocks, without an error. Each block becomes a named
    child instead (`model/block_0/...`).
    """

    def _add_blocks(self, count, attention, norm="layer", attention_options=None,
                    **block_options):
        """`count` blocks with `attention` (`"causal"` or `"bidirectional"`),
        `norm` (`"layer"` or `"rms"`), each block's `attention_options`
        (a list, one dict per block) and the decoder's `block_options`
        (`TransformerBlock`'s `feedforward`, `residual`, ...)."""
        policy = self.dtype_policy
        self.blocks = [
            TransformerBlock(
                self.hidden_dim,
                self.num_heads,
                self.intermediate_dim,
                attention=attention,
                dropout=self.dropout,
                activation=self.activation,
                norm_first=self.norm_first,
                layer_norm_epsilon=self.layer_norm_epsilon,
                norm=norm,
                attention_options=attention_options[index] if attention_options else None,
                dtype=policy,
                name=f"block_{index}",
                **block_options,
            )
            for index in range(count)
        ]
        norm_class = RMSNorm if norm == "rms" else LayerNorm
        self.final_norm = (
            norm_class(epsilon=self.layer_norm_epsilon, dtype=policy, name="final_norm")
            if self.norm_first
            else None
        )

    def _build_blocks(self, hidden_shape):
        for block in self.blocks:
            block.build(hidden_shape)
        if self.final_norm is not None:
            self.final_norm.build(hidden_shape)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "checkpoint":
            children.update({block.name: block for block in self.blocks})
        return children
