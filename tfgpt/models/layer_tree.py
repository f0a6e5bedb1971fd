"""The one public listing of the layers inside a tfgpt model."""


class LayerTree:
    """Mixin of every tfgpt model (`ConfiguredModel`, `EncoderTaskModel`): `sublayers()`.

    Recomputation, ZeRO stage 3, tensor-parallel seeds, checkpoint keys and
    adapters each act on one kind of layer (transformer blocks, dropouts,
    projections) wherever a model holds it. They ask the model for its
    layers here instead of walking Keras's private tracking
    (`Layer._flatten_layers`) themselves.
    """

    def sublayers(self):
        """Every layer inside the model, not the model itself: depth first, in
        the order they were assigned, a shared layer (ALBERT's blocks) once."""
        return list(self._flatten_layers(include_self=False))
