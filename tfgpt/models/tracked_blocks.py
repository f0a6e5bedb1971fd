"""Makes a model's list of blocks visible to `tf.train.Checkpoint`."""


class TrackedBlocks:
    """Mixin for Keras models that keep their blocks in `self.blocks`.

    Keras 3 (3.15) hands a list attribute of layers to SavedModel but not to
    `tf.train.Checkpoint`: `Checkpoint(model=model)` would save and restore
    everything but the blocks, without an error. Each block becomes a named
    child instead (`model/block_0/...`).
    """

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "checkpoint":
            children.update({block.name: block for block in self.blocks})
        return children
